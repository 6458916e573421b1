// LocalPrefetcher: a queue of paths and threads that bring those not yet cached into the page cache.
#include "fanrun/prefetch_local.h"

#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "fanrun/fd.h"

namespace fanrun {

LocalPrefetcher::LocalPrefetcher(int threads) : pool_(threads, [this](const std::string& path) { Give(path); }) {
  Result<FileDescriptor> null = OpenFile("/dev/null", O_WRONLY);
  if (null.ok()) null_ = std::move(*null);
}

LocalPrefetcher::~LocalPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    pending_.clear();
    pool_.Clear();
  }
  given_.notify_all();
  pool_.Stop();
}

namespace {

// cachestat(2), Linux 6.5: how many pages of a range are in the page cache, without reading.
// Declared here, as the C library's headers may predate it.
constexpr long kCachestatSyscall = 451;  // the same number on every architecture
struct CachestatRange {
  uint64_t off;
  uint64_t len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

// Whether the file's last page is in the page cache. Readers read files from the start, so a
// cached last page means the whole file was read. cachestat() looks without any I/O; where it
// is missing, a 1-byte read with RWF_NOWAIT, which fails with EAGAIN instead of waiting for
// the disk (but starts reading that page: one small extra request per file not cached). Any
// other failure counts as not cached, so the hint is still given.
bool LastPageCached(int fd, off_t size) {
  if (size == 0) return false;
  CachestatRange range{static_cast<uint64_t>(size - 1), 1};
  Cachestat stat{};
  if (::syscall(kCachestatSyscall, fd, &range, &stat, 0) == 0) return stat.nr_cache > 0;
  char byte;
  struct iovec iov {&byte, 1};
  return ::preadv2(fd, &iov, 1, size - 1, RWF_NOWAIT) == 1;
}

}  // namespace

void LocalPrefetcher::Hint(std::vector<std::string> paths) {
  std::vector<std::string> given;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& path : paths) {
    if (resident_streak_ >= kResidentStreak && since_probe_++ % kProbeEvery != 0) {
      ++counts_.skipped;
      continue;
    }
    ++pending_[path];
    given.push_back(std::move(path));
  }
  pool_.Submit(std::move(given));
}

void LocalPrefetcher::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  given_.wait(lock, [this] { return pending_.empty(); });
}

void LocalPrefetcher::Wait(const std::string& path) {
  std::unique_lock<std::mutex> lock(mutex_);
  given_.wait(lock, [&] { return pending_.find(path) == pending_.end(); });
}

bool LocalPrefetcher::Resident(const std::string& path) {
  Result<FileDescriptor> file = OpenFile(path, O_RDONLY);
  struct stat st {};
  return file.ok() && ::fstat(file->fd(), &st) == 0 && LastPageCached(file->fd(), st.st_size);
}

LocalPrefetcher::Counts LocalPrefetcher::counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

bool LocalPrefetcher::ReadThrough(int fd, off_t size) {
  if (!null_.valid()) return false;
  off_t offset = 0;
  while (offset < size && !stopping_.load(std::memory_order_relaxed)) {
    const ssize_t sent = ::sendfile(null_.fd(), fd, &offset, kReadThroughStep);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return offset > 0;  // no sendfile here, or a read error the reader will meet
  }
  return true;
}

void LocalPrefetcher::Give(const std::string& path) {
  if (stopping_) return;
  enum { kFailed, kResident, kHinted } outcome = kFailed;
  Result<FileDescriptor> file = OpenFile(path, O_RDONLY);
  struct stat st {};
  if (file.ok() && ::fstat(file->fd(), &st) == 0) {
    if (LastPageCached(file->fd(), st.st_size)) {
      outcome = kResident;
    } else if (st.st_size >= kReadThroughBytes && ReadThrough(file->fd(), st.st_size)) {
      outcome = kHinted;
    } else if (::posix_fadvise(file->fd(), 0, 0, POSIX_FADV_WILLNEED) == 0) {
      outcome = kHinted;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (const auto it = pending_.find(path); it != pending_.end() && --it->second == 0) pending_.erase(it);
  given_.notify_all();
  if (outcome == kResident) {
    ++counts_.resident;
    ++resident_streak_;
  } else {
    ++(outcome == kHinted ? counts_.hinted : counts_.failed);
    resident_streak_ = 0;
    since_probe_ = 0;
  }
}

}  // namespace fanrun
