// Atomic publication of checkpoint directories: renameat2 and directory fsync.
#include "fanrun/checkpoint_publish.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include "fanrun/fd.h"

namespace fanrun {
namespace {

std::string ParentOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

int Rename(const std::string& from, const std::string& to, unsigned int flags) {
  int rc;
  do {
    rc = ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), flags);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

}  // namespace

Status SyncDirectory(const std::string& path) {
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor dir, OpenFile(path, O_RDONLY | O_DIRECTORY));
  if (::fsync(dir.fd()) != 0) return Status::IOErrorFromErrno(errno, "Failed to fsync directory '", path, "'");
  return dir.Close();
}

Result<std::string> PublishDirectory(const std::string& staging, const std::string& target) {
  FANRUN_RETURN_NOT_OK(SyncDirectory(staging));
  std::string previous;
  if (Rename(staging, target, RENAME_NOREPLACE) != 0) {
    const int err = errno;
    if (err == EEXIST) {
      if (Rename(staging, target, RENAME_EXCHANGE) == 0) {
        previous = staging;
      } else if (errno == EINVAL) {
        // No RENAME_EXCHANGE on this filesystem: move the old one aside, then the new one in.
        previous = staging + ".previous";
        if (Rename(target, previous, 0) != 0) {
          return Status::IOErrorFromErrno(errno, "Failed to move the previous checkpoint '", target, "' aside");
        }
        if (Rename(staging, target, 0) != 0) {
          return Status::IOErrorFromErrno(errno, "Failed to publish '", staging, "' as '", target,
                                          "' (the previous checkpoint is at '", previous, "')");
        }
      } else {
        return Status::IOErrorFromErrno(errno, "Failed to swap '", staging, "' with the existing '", target, "'");
      }
    } else if (err == EINVAL) {
      // No renameat2 flags at all on this filesystem; the coordinator checked that target did
      // not exist, and a plain rename onto a missing directory is still atomic.
      if (Rename(staging, target, 0) != 0) {
        return Status::IOErrorFromErrno(errno, "Failed to publish '", staging, "' as '", target, "'");
      }
    } else {
      return Status::IOErrorFromErrno(err, "Failed to publish '", staging, "' as '", target, "'");
    }
  }
  FANRUN_RETURN_NOT_OK(SyncDirectory(ParentOf(target)));
  if (ParentOf(staging) != ParentOf(target)) FANRUN_RETURN_NOT_OK(SyncDirectory(ParentOf(staging)));
  return previous;
}

}  // namespace fanrun
