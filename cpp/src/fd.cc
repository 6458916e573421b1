// Owned file descriptors and pipes.
#include "fanrun/fd.h"

#include <fcntl.h>
#include <unistd.h>

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
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::IOErrorFromErrno(errno, "Failed to create a pipe");
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
    return Status::IOErrorFromErrno(err, "Failed to open '", path, "'");
  }
  return FileDescriptor(fd);
}

Result<FileDescriptor> DuplicateAbove(int fd, int min_fd) {
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, min_fd);
  if (dup < 0) return Status::IOErrorFromErrno(errno, "Failed to duplicate descriptor ", fd);
  return FileDescriptor(dup);
}

Status SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return Status::IOErrorFromErrno(errno, "Failed to make descriptor ", fd, " non-blocking");
  }
  return Status::OK();
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

}  // namespace fanrun
