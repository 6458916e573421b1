// The private-directory rule (private_dir.h): directories walked one component at a time from
// '/', each checked on its descriptor; files opened without following a link.
#include "fanrun/private_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <vector>

namespace fanrun {
namespace {

constexpr int kDirectoryFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;

std::string ModeText(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// A NUL would end the path where the system reads it, somewhere else than where it was meant.
Status RefuseNul(const std::string& text, const std::string& what) {
  if (text.find('\0') == std::string::npos) return Status::OK();
  std::string shown;
  for (char c : text) shown += c == '\0' ? std::string("\\x00") : std::string(1, c);
  return Status::Invalid(what, " '", shown, "' holds a NUL byte, which no file name can hold");
}

// A name opened in its directory names one entry of it, no other.
Status CheckEntryName(const std::string& name, const std::string& what) {
  FANRUN_RETURN_NOT_OK(RefuseNul(name, what));
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    return Status::Invalid(what, " '", name, "' is not the name of an entry in its directory: it must be one name, "
                           "without '/', and not '.' or '..'");
  }
  return Status::OK();
}

// The components of `path` made absolute (against the working directory) and normalized as
// written, '.' and '..' taken out without following any link: the directories walked are the
// ones the path names.
Result<std::vector<std::string>> AbsoluteComponents(const std::string& path) {
  std::string absolute = path;
  if (path.empty() || path[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) == nullptr) return Status::IOErrorFromErrno(errno, "Failed to read the working directory");
    absolute = std::string(cwd) + "/" + path;
  }
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= absolute.size()) {
    size_t end = absolute.find('/', start);
    if (end == std::string::npos) end = absolute.size();
    const std::string part = absolute.substr(start, end - start);
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(part);
    }
    start = end + 1;
  }
  return parts;
}

std::string Join(const std::string& parent, const std::string& name) {
  return parent.empty() || parent.back() == '/' ? parent + name : parent + "/" + name;
}

Result<struct stat> Stat(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return Status::IOErrorFromErrno(errno, "Failed to stat '", path, "'");
  return st;
}

// The directory fanrun keeps its files in: its user's own, and no one else may write it.
Status CheckOwn(const struct stat& st, const std::string& path, const DirectoryDescription& d) {
  const uid_t me = ::geteuid();
  if (st.st_uid != me) {
    return Status::UnsafePath(d.what, " '", path, "' belongs to uid ", st.st_uid, ", not to you (uid ", me,
                              "): its owner could plant files that fanrun would load, or read what fanrun writes there. ",
                              d.remedy);
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return Status::UnsafePath(d.what, " '", path, "' can be written by other users (mode ", ModeText(st.st_mode),
                              "): they could plant files or links in it. Remove their write access (chmod go-w '", path,
                              "'), or: ", d.remedy);
  }
  return Status::OK();
}

// A directory above it: whoever may rename its entries could put another directory in place of
// the one checked.
Status CheckAbove(const struct stat& st, const std::string& path, const DirectoryDescription& d) {
  const uid_t me = ::geteuid();
  if (st.st_uid != 0 && st.st_uid != me) {
    return Status::UnsafePath(d.what, " lies under '", path, "', which belongs to uid ", st.st_uid,
                              ": that user could move another directory in its place. ", d.remedy);
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    return Status::UnsafePath(d.what, " lies under '", path, "', which other users can write (mode ",
                              ModeText(st.st_mode), ") and is not sticky: they could move another directory in its place. ",
                              d.remedy);
  }
  return Status::OK();
}

// Opens the directory `name` under parent_fd, making it 0700 where it is missing. A link in its
// place is followed only where follow_trusted_link is set and root or this user made it: in a
// directory only they can change, what it leads to is then checked as any other level.
Result<FileDescriptor> OpenOrMake(int parent_fd, const std::string& name, const std::string& path,
                                  const DirectoryDescription& d, bool follow_trusted_link) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int fd = ::openat(parent_fd, name.c_str(), kDirectoryFlags);
    if (fd >= 0) return FileDescriptor(fd);
    const int err = errno;
    if (err != ENOENT) {
      // O_NOFOLLOW with O_DIRECTORY reports a link as "not a directory".
      struct stat link;
      const bool is_link = (err == ELOOP || err == ENOTDIR) &&
                           ::fstatat(parent_fd, name.c_str(), &link, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(link.st_mode);
      if (!is_link) return Status(StatusCode::kIOError, internal::StrCat(d.what, ": '", path, "': ", Status::ErrnoMessage(err)), err);
      if (!follow_trusted_link) {
        return Status::UnsafePath(d.what, ": '", path, "' is a symbolic link, and fanrun follows no link to the "
                                  "directory it keeps files in. ", d.remedy);
      }
      if (link.st_uid != 0 && link.st_uid != ::geteuid()) {
        return Status::UnsafePath(d.what, ": '", path, "' is a symbolic link made by uid ", link.st_uid,
                                  ", and fanrun follows no link that another user made. ", d.remedy);
      }
      const int followed = ::openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (followed < 0) return Status::IOErrorFromErrno(errno, d.what, ": '", path, "'");
      return FileDescriptor(followed);
    }
    if (::mkdirat(parent_fd, name.c_str(), 0700) != 0) {
      if (errno == EEXIST) continue;  // made by another process meanwhile: opened as it is
      const int mkdir_err = errno;
      return Status(StatusCode::kIOError,
                    internal::StrCat(d.what, ": could not create '", path, "': ", Status::ErrnoMessage(mkdir_err), ". ",
                                     d.remedy),
                    mkdir_err);
    }
    const int made = ::openat(parent_fd, name.c_str(), kDirectoryFlags);
    if (made < 0) return Status::IOErrorFromErrno(errno, d.what, ": '", path, "'");
    FileDescriptor dir(made);
    // mkdir's mode passed through the umask; what fanrun makes is exactly 0700.
    if (::fchmod(dir.fd(), 0700) != 0) return Status::IOErrorFromErrno(errno, "Failed to chmod '", path, "'");
    return dir;
  }
  return Status(StatusCode::kIOError, internal::StrCat(d.what, ": '", path, "' vanished while it was opened"), ENOENT);
}

}  // namespace

Result<PrivateDirectory> OpenPrivateDirectory(const std::string& path, const DirectoryDescription& d) {
  FANRUN_RETURN_NOT_OK(RefuseNul(path, d.what));
  FANRUN_ASSIGN_OR_RETURN(const std::vector<std::string> parts, AbsoluteComponents(path));
  if (parts.empty()) return Status::UnsafePath(d.what, " cannot be '/'. ", d.remedy);
  const int root = ::open("/", kDirectoryFlags);
  if (root < 0) return Status::IOErrorFromErrno(errno, "Failed to open '/'");
  FileDescriptor current(root);
  std::string walked = "/";
  FANRUN_ASSIGN_OR_RETURN(struct stat st, Stat(current.fd(), walked));
  FANRUN_RETURN_NOT_OK(CheckAbove(st, walked, d));
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool last = i + 1 == parts.size();
    walked = Join(walked, parts[i]);
    FANRUN_ASSIGN_OR_RETURN(FileDescriptor next, OpenOrMake(current.fd(), parts[i], walked, d, !last));
    FANRUN_ASSIGN_OR_RETURN(st, Stat(next.fd(), walked));
    FANRUN_RETURN_NOT_OK(last ? CheckOwn(st, walked, d) : CheckAbove(st, walked, d));
    current = std::move(next);
  }
  return PrivateDirectory{std::move(current), walked};
}

Result<FileDescriptor> OpenPrivateSubdirectory(int parent_fd, const std::string& parent_path, const std::string& name,
                                               const DirectoryDescription& d) {
  FANRUN_RETURN_NOT_OK(CheckEntryName(name, d.what));
  const std::string path = Join(parent_path, name);
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor fd, OpenOrMake(parent_fd, name, path, d, false));
  FANRUN_ASSIGN_OR_RETURN(struct stat st, Stat(fd.fd(), path));
  FANRUN_RETURN_NOT_OK(CheckOwn(st, path, d));
  if ((st.st_mode & 07777) != 0700 && ::fchmod(fd.fd(), 0700) != 0) {
    return Status::IOErrorFromErrno(errno, "Failed to chmod '", path, "'");
  }
  return fd;
}

Result<FileDescriptor> OpenPrivateFile(int dir_fd, const std::string& name, int flags) {
  FANRUN_RETURN_NOT_OK(CheckEntryName(name, "The file name"));
  const int opened = ::openat(dir_fd, name.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (opened < 0) {
    if (errno == ELOOP) {
      return Status::UnsafePath(name, " is a symbolic link, and fanrun follows none in its own directories");
    }
    return Status::IOErrorFromErrno(errno, "Failed to open '", name, "'");
  }
  FileDescriptor fd(opened);
  FANRUN_ASSIGN_OR_RETURN(struct stat st, Stat(fd.fd(), name));
  const uid_t me = ::geteuid();
  if (!S_ISREG(st.st_mode)) return Status::UnsafePath(name, " is not a regular file");
  if (st.st_uid != me) return Status::UnsafePath(name, " belongs to uid ", st.st_uid, ", not to you (uid ", me, ")");
  if ((st.st_mode & 077) != 0) {
    return Status::UnsafePath("others can read or write ", name, " (mode ", ModeText(st.st_mode), ")");
  }
  return fd;
}

}  // namespace fanrun
