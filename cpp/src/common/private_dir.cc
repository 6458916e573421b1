// Opening directories only their owner can write, one component at a time.
#include "fanrun/private_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <vector>

namespace fanrun {
namespace {

constexpr int kDirectoryFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;

// `path` made absolute, with the links of the part that exists resolved; a missing tail is
// kept as written, to be created under the resolved part.
Result<std::string> CanonicalPath(const std::string& path) {
  if (path.empty()) return Status::Invalid("A directory path must not be empty");
  std::string head = path;
  if (head[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) == nullptr) return Status::IOErrorFromErrno(errno, "Failed to read the working directory");
    head = std::string(cwd) + "/" + path;
  }
  std::string tail;
  while (true) {
    char* resolved = ::realpath(head.c_str(), nullptr);
    if (resolved != nullptr) {
      std::string out(resolved);
      std::free(resolved);
      if (!tail.empty()) out += (out == "/" ? "" : "/") + tail;
      return out;
    }
    if (errno != ENOENT) return Status::IOErrorFromErrno(errno, "Failed to resolve '", path, "'");
    while (head.size() > 1 && head.back() == '/') head.pop_back();
    const size_t slash = head.rfind('/');
    const std::string base = head.substr(slash + 1);
    if (base == "..") return Status::Invalid("'", path, "' climbs with '..' out of a directory that does not exist");
    if (!base.empty() && base != ".") tail = tail.empty() ? base : base + "/" + tail;
    head = slash == 0 ? "/" : head.substr(0, slash);
  }
}

std::vector<std::string> Components(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 1;
  while (start <= path.size()) {
    const size_t end = path.find('/', start);
    const std::string part = path.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!part.empty() && part != ".") parts.push_back(part);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return parts;
}

std::string ModeText(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// The directory fanrun writes in: this user's own, and no one else may write it.
Status CheckOwnDirectory(const struct stat& st, const std::string& path) {
  const uid_t me = ::geteuid();
  if (!S_ISDIR(st.st_mode)) return Status::Invalid("'", path, "' is not a directory");
  if (st.st_uid != me) {
    return Status::Invalid("'", path, "' belongs to uid ", st.st_uid, ", not to uid ", me,
                           " (this process): its owner could plant files in it or read what fanrun writes there");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return Status::Invalid("'", path, "' can be written by other users (mode ", ModeText(st.st_mode),
                           "): they could plant files or links in it; remove their write access (chmod go-w)");
  }
  return Status::OK();
}

// A directory above it: whoever may rename its entries could put another directory in place
// of the one that was checked.
Status CheckAncestor(const struct stat& st, const std::string& path) {
  const uid_t me = ::geteuid();
  if (st.st_uid != 0 && st.st_uid != me) {
    return Status::Invalid("'", path, "', on the way to the directory, belongs to uid ", st.st_uid,
                           ", who could move another directory in place of what lies below it");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    return Status::Invalid("'", path, "', on the way to the directory, can be written by other users (mode ",
                           ModeText(st.st_mode), ") and is not sticky: they could move another directory in place of "
                           "what lies below it");
  }
  return Status::OK();
}

// Opens `name` under `parent`, creating it 0700 if it is missing; *created says whether this
// call made it.
Result<FileDescriptor> OpenOrMake(int parent, const std::string& name, const std::string& path, bool* created) {
  *created = false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int fd = ::openat(parent, name.c_str(), kDirectoryFlags);
    if (fd >= 0) return FileDescriptor(fd);
    if (errno == ELOOP || errno == ENOTDIR) {
      return Status::Invalid("'", path, "' is a symbolic link or not a directory; fanrun does not follow links there");
    }
    if (errno != ENOENT) return Status::IOErrorFromErrno(errno, "Failed to open '", path, "'");
    if (::mkdirat(parent, name.c_str(), 0700) == 0) {
      *created = true;
    } else if (errno != EEXIST) {
      return Status::IOErrorFromErrno(errno, "Failed to create '", path, "'");
    }
  }
  return Status::IOError("'", path, "' vanished while it was being opened");
}

Result<struct stat> Stat(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return Status::IOErrorFromErrno(errno, "Failed to stat '", path, "'");
  return st;
}

}  // namespace

Result<PrivateDirectory> OpenPrivateDirectory(const std::string& path) {
  FANRUN_ASSIGN_OR_RETURN(std::string canonical, CanonicalPath(path));
  const int root = ::open("/", kDirectoryFlags);
  if (root < 0) return Status::IOErrorFromErrno(errno, "Failed to open '/'");
  FileDescriptor current(root);
  std::string walked = "/";
  const std::vector<std::string> parts = Components(canonical);
  if (parts.empty()) return Status::Invalid("'/' cannot be fanrun's directory");
  FANRUN_ASSIGN_OR_RETURN(struct stat st, Stat(current.fd(), walked));
  FANRUN_RETURN_NOT_OK(CheckAncestor(st, walked));
  for (size_t i = 0; i < parts.size(); ++i) {
    walked += (walked == "/" ? "" : "/") + parts[i];
    bool created = false;
    FANRUN_ASSIGN_OR_RETURN(FileDescriptor next, OpenOrMake(current.fd(), parts[i], walked, &created));
    // mkdir's mode passes through the umask; what fanrun makes is exactly 0700.
    if (created && ::fchmod(next.fd(), 0700) != 0) return Status::IOErrorFromErrno(errno, "Failed to chmod '", walked, "'");
    FANRUN_ASSIGN_OR_RETURN(st, Stat(next.fd(), walked));
    FANRUN_RETURN_NOT_OK(i + 1 == parts.size() ? CheckOwnDirectory(st, walked) : CheckAncestor(st, walked));
    current = std::move(next);
  }
  return PrivateDirectory{std::move(current), canonical};
}

Result<FileDescriptor> OpenPrivateSubdirectory(const PrivateDirectory& parent, const std::string& name) {
  const std::string path = parent.path + "/" + name;
  bool created = false;
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor fd, OpenOrMake(parent.fd.fd(), name, path, &created));
  FANRUN_ASSIGN_OR_RETURN(struct stat st, Stat(fd.fd(), path));
  FANRUN_RETURN_NOT_OK(CheckOwnDirectory(st, path));
  if ((st.st_mode & 07777) != 0700 && ::fchmod(fd.fd(), 0700) != 0) {
    return Status::IOErrorFromErrno(errno, "Failed to chmod '", path, "'");
  }
  return fd;
}

}  // namespace fanrun
