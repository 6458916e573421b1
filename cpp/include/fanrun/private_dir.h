// Directories and files that are their user's alone, for everything fanrun keeps on disk (runs,
// caches, locks, the tracking store): fanrun's one statement of the rule, which Python calls
// through fanrun._core (src/fanrun/_private_dir.py). Another user who could write such a
// directory, or one above it, could plant links or files that fanrun would then load, write
// through or serve.
//
// The rule: the directory itself belongs to this process's user, nobody else can write it, and
// it is not a link. Each directory above it belongs to that user or to root, and nobody else can
// write it unless it is sticky (as /tmp is), so that no one can move another directory in place
// of the one checked. A link above the directory (a home under /data, say) is followed only
// where it belongs to root or to the user, and what it leads to is checked the same way. Every
// component is opened relative to its parent and checked on its descriptor. What fanrun makes is
// 0700 (directories) and 0600 (files), whatever the umask; files are opened relative to their
// directory's descriptor, never through a link. A refusal is StatusCode::kUnsafePath and says
// which path is wrong, why, and what to do.
#pragma once

#include <string>

#include "fanrun/fd.h"
#include "fanrun/status.h"

namespace fanrun {

// How a refusal names the directory, and what it tells the user to do instead.
struct DirectoryDescription {
  std::string what;    // "The cache directory"
  std::string remedy;  // the refusal's last sentence: "Use a directory that ..."
};

struct PrivateDirectory {
  FileDescriptor fd;  // O_DIRECTORY, close-on-exec
  std::string path;   // absolute, normalized as written: the links above it are followed, not resolved
};

// Opens `path` (relative: to the working directory), creating it and each missing directory
// above it with mode 0700, each one checked by the rule on its way down.
Result<PrivateDirectory> OpenPrivateDirectory(const std::string& path, const DirectoryDescription& description);

// Opens or creates (0700) the subdirectory `name` of the private directory open at parent_fd
// (parent_path names it in messages), checked as the directory itself; one that exists with a
// wider mode is narrowed to 0700, as fanrun made it.
Result<FileDescriptor> OpenPrivateSubdirectory(int parent_fd, const std::string& parent_path, const std::string& name,
                                               const DirectoryDescription& description);
inline Result<FileDescriptor> OpenPrivateSubdirectory(const PrivateDirectory& parent, const std::string& name,
                                                      const DirectoryDescription& description) {
  return OpenPrivateSubdirectory(parent.fd.fd(), parent.path, name, description);
}

// Opens the file `name` of the directory open at dir_fd with `flags` (open(2)'s), never through a
// link; a file it creates is 0600. Refused unless it is a regular file of this user's that
// nobody else can read or write.
Result<FileDescriptor> OpenPrivateFile(int dir_fd, const std::string& name, int flags);

}  // namespace fanrun
