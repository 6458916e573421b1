// LocalPrefetcher: a queue of paths and threads that bring those not yet cached into the page cache.
#include "fanrun/prefetch_local.h"

#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <utility>

#include "fanrun/fd.h"

namespace fanrun {

LocalPrefetcher::LocalPrefetcher(int threads) {
  Result<FileDescriptor> null = OpenFile("/dev/null", O_WRONLY);
  if (null.ok()) null_ = std::move(*null);
  for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) threads_.emplace_back([this] { Run(); });
}

LocalPrefetcher::~LocalPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    queue_.clear();
    pending_.clear();
  }
  given_.notify_all();
  work_ready_.notify_all();
  for (auto& thread : threads_) thread.join();
}

namespace {

// Whether the file's last byte is in the page cache: read with RWF_NOWAIT, which fails with
// EAGAIN instead of going to the disk. Readers read files from the start, so a cached last
// byte means the whole file was read. Any other failure (a filesystem without RWF_NOWAIT)
// counts as not cached, so the hint is still given.
bool LastByteCached(int fd, off_t size) {
  if (size == 0) return false;
  char byte;
  struct iovec iov {&byte, 1};
  return ::preadv2(fd, &iov, 1, size - 1, RWF_NOWAIT) == 1;
}

}  // namespace

void LocalPrefetcher::Hint(std::vector<std::string> paths) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t queued = queue_.size();
    for (auto& path : paths) {
      if (resident_streak_ >= kResidentStreak && since_probe_++ % kProbeEvery != 0) {
        ++counts_.skipped;
        continue;
      }
      ++pending_[path];
      queue_.push_back(std::move(path));
    }
    if (queue_.size() == queued) return;
  }
  work_ready_.notify_one();
}

void LocalPrefetcher::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return queue_.empty() && busy_ == 0; });
}

void LocalPrefetcher::Wait(const std::string& path) {
  std::unique_lock<std::mutex> lock(mutex_);
  given_.wait(lock, [&] { return pending_.find(path) == pending_.end(); });
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

void LocalPrefetcher::Run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const std::string path = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lock.unlock();
    enum { kFailed, kResident, kHinted } outcome = kFailed;
    Result<FileDescriptor> file = OpenFile(path, O_RDONLY);
    struct stat st {};
    if (file.ok() && ::fstat(file->fd(), &st) == 0) {
      if (LastByteCached(file->fd(), st.st_size)) {
        outcome = kResident;
      } else if (st.st_size >= kReadThroughBytes && ReadThrough(file->fd(), st.st_size)) {
        outcome = kHinted;
      } else if (::posix_fadvise(file->fd(), 0, 0, POSIX_FADV_WILLNEED) == 0) {
        outcome = kHinted;
      }
    }
    lock.lock();
    --busy_;
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
    if (queue_.empty() && busy_ == 0) idle_.notify_all();
  }
}

}  // namespace fanrun
