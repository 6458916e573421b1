// Owned file descriptors, pipes and directory listings: move-only, close-on-exec from birth,
// closed once.
#pragma once

#include <dirent.h>

#include <cstddef>
#include <string>

#include "fanrun/status.h"

namespace fanrun {

class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.Release()) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closing twice is a no-op; the second call returns OK.
  Status Close();
  // Gives up ownership without closing.
  int Release();

 private:
  int fd_ = -1;
};

struct Pipe {
  FileDescriptor read;
  FileDescriptor write;
};

// Both ends close-on-exec.
Result<Pipe> MakePipe();

// Opens with O_CLOEXEC added to flags.
Result<FileDescriptor> OpenFile(const std::string& path, int flags, int mode = 0600);

// A close-on-exec duplicate numbered at least min_fd, so that a later dup2 onto
// 0..min_fd-1 never overwrites one of its own sources.
Result<FileDescriptor> DuplicateAbove(int fd, int min_fd);

Status SetNonBlocking(int fd);
Status SetBlocking(int fd);

// The error for a descriptor that could not be made (`err` from the call, `what` names it).
// When the process is out of descriptors it names RLIMIT_NOFILE, its value and how to raise it.
Status DescriptorError(int err, const std::string& what);

// Retries on EINTR and short writes.
Status WriteAll(int fd, const void* data, size_t size);

// The entries of one directory, read with readdir; closedir when it goes.
class DirectoryListing {
 public:
  // The entries of `path`.
  static Result<DirectoryListing> Open(const std::string& path);
  // The entries of the directory open at dir_fd, read through a descriptor of their own, so
  // that dir_fd keeps its offset and stays open; `path` names it in errors.
  static Result<DirectoryListing> OpenAt(int dir_fd, const std::string& path);
  DirectoryListing(DirectoryListing&& other) noexcept : dir_(other.dir_) { other.dir_ = nullptr; }
  DirectoryListing& operator=(DirectoryListing&& other) noexcept;
  DirectoryListing(const DirectoryListing&) = delete;
  DirectoryListing& operator=(const DirectoryListing&) = delete;
  ~DirectoryListing();

  // The next entry's name, "." and ".." among them; nullptr after the last.
  const char* Next();

 private:
  explicit DirectoryListing(DIR* dir) : dir_(dir) {}
  // Takes `fd` (-1: its open failed, errno says why) and lists it.
  static Result<DirectoryListing> FromDescriptor(int fd, const std::string& path);

  DIR* dir_ = nullptr;
};

}  // namespace fanrun
