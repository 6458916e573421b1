// Owned file descriptors, pipes and directory listings.
#include "fanrun/fd.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

namespace fanrun {

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    FANRUN_WARN_NOT_OK(Close(), "closing a replaced descriptor");
    fd_ = other.Release();
  }
  return *this;
}

FileDescriptor::~FileDescriptor() { FANRUN_WARN_NOT_OK(Close(), "closing a descriptor"); }

Status FileDescriptor::Close() {
  if (fd_ < 0) return Status::OK();
  const int fd = fd_;
  fd_ = -1;
  // Linux frees the descriptor even when close reports EINTR: never retry.
  if (::close(fd) != 0 && errno != EINTR) {
    return Status::IOErrorFromErrno(errno, "Failed to close descriptor ", fd);
  }
  return Status::OK();
}

int FileDescriptor::Release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

Result<Pipe> MakePipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return DescriptorError(errno, "Failed to create a pipe");
  return Pipe{FileDescriptor(fds[0]), FileDescriptor(fds[1])};
}

Result<FileDescriptor> OpenFile(const std::string& path, int flags, int mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status::NotFound("Failed to open '", path, "': no such file or directory");
    return DescriptorError(err, internal::StrCat("Failed to open '", path, "'"));
  }
  return FileDescriptor(fd);
}

Result<FileDescriptor> DuplicateAbove(int fd, int min_fd) {
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, min_fd);
  // EINVAL: min_fd is at or beyond the limit, so no number is free above it.
  if (dup < 0) {
    return DescriptorError(errno == EINVAL ? EMFILE : errno, internal::StrCat("Failed to duplicate descriptor ", fd));
  }
  return FileDescriptor(dup);
}

Status SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return Status::IOErrorFromErrno(errno, "Failed to make descriptor ", fd, " non-blocking");
  }
  return Status::OK();
}

Status SetBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return Status::IOErrorFromErrno(errno, "Failed to make descriptor ", fd, " blocking");
  }
  return Status::OK();
}

Status DescriptorError(int err, const std::string& what) {
  if (err == ENFILE) {
    return Status::IOError(what, ": the system's table of open files is full (ENFILE; see sysctl fs.file-max)");
  }
  if (err != EMFILE) return Status::IOErrorFromErrno(err, what);
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  const rlim_t suggested = std::min<rlim_t>(std::max<rlim_t>(4096, 2 * limit.rlim_cur), limit.rlim_max);
  const std::string hard = limit.rlim_max == RLIM_INFINITY ? std::string("unlimited") : std::to_string(limit.rlim_max);
  return Status::IOError(what, ": out of file descriptors: this process may have at most ", limit.rlim_cur,
                         " open (RLIMIT_NOFILE; its hard limit is ", hard,
                         "). Raise it before starting Python, e.g. `ulimit -n ", suggested,
                         "`, or in Python with resource.setrlimit(resource.RLIMIT_NOFILE, (", suggested,
                         ", hard)), or run fewer ranks");
}

Status WriteAll(int fd, const void* data, size_t size) {
  const char* cursor = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, cursor, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::IOErrorFromErrno(errno, "Failed to write to descriptor ", fd);
    }
    cursor += n;
    size -= static_cast<size_t>(n);
  }
  return Status::OK();
}

Result<DirectoryListing> DirectoryListing::Open(const std::string& path) {
  return FromDescriptor(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC), path);
}

Result<DirectoryListing> DirectoryListing::OpenAt(int dir_fd, const std::string& path) {
  return FromDescriptor(::openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC), path);
}

Result<DirectoryListing> DirectoryListing::FromDescriptor(int fd, const std::string& path) {
  if (fd < 0) return Status::IOErrorFromErrno(errno, "Failed to list '", path, "'");
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    const int err = errno;
    ::close(fd);
    return Status::IOErrorFromErrno(err, "Failed to list '", path, "'");
  }
  return DirectoryListing(dir);
}

DirectoryListing& DirectoryListing::operator=(DirectoryListing&& other) noexcept {
  if (this != &other) {
    if (dir_ != nullptr) ::closedir(dir_);
    dir_ = other.dir_;
    other.dir_ = nullptr;
  }
  return *this;
}

DirectoryListing::~DirectoryListing() {
  if (dir_ != nullptr) ::closedir(dir_);
}

const char* DirectoryListing::Next() {
  const dirent* entry = ::readdir(dir_);
  return entry != nullptr ? entry->d_name : nullptr;
}

}  // namespace fanrun
