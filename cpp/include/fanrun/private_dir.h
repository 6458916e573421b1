// Directories only their owner can write, opened without following links, for what fanrun
// keeps on disk (the file cache). Another user who could write such a directory, or one above
// it, could plant links or files that fanrun would then write through or serve.
#pragma once

#include <string>

#include "fanrun/fd.h"
#include "fanrun/status.h"

namespace fanrun {

struct PrivateDirectory {
  FileDescriptor fd;  // O_DIRECTORY, close-on-exec
  std::string path;   // absolute, with the links of its existing part resolved
};

// Opens `path`, creating it and any missing parent with mode 0700 (exactly, whatever the
// umask). Each component is opened relative to its parent with O_NOFOLLOW and checked on its
// descriptor: the directory itself must belong to this process's user and be writable by
// nobody else; each one above it must belong to that user or to root, and be writable by
// nobody else unless it is sticky (as /tmp is), so that no one can move another in its place.
// A refusal says which directory is wrong and why.
Result<PrivateDirectory> OpenPrivateDirectory(const std::string& path);

// Opens or creates (0700) the subdirectory `name` of an open private directory, with the same
// checks as the directory itself; one that exists with a wider mode is narrowed to 0700, as
// fanrun made it.
Result<FileDescriptor> OpenPrivateSubdirectory(const PrivateDirectory& parent, const std::string& name);

}  // namespace fanrun
