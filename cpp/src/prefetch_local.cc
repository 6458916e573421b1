// LocalPrefetcher: a queue of paths and threads that pass them to posix_fadvise.
#include "fanrun/prefetch_local.h"

#include <fcntl.h>

#include <utility>

#include "fanrun/fd.h"

namespace fanrun {

LocalPrefetcher::LocalPrefetcher(int threads) {
  for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) threads_.emplace_back([this] { Run(); });
}

LocalPrefetcher::~LocalPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    queue_.clear();
  }
  work_ready_.notify_all();
  for (auto& thread : threads_) thread.join();
}

void LocalPrefetcher::Hint(std::vector<std::string> paths) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& path : paths) queue_.push_back(std::move(path));
  }
  work_ready_.notify_one();
}

void LocalPrefetcher::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return queue_.empty() && busy_ == 0; });
}

uint64_t LocalPrefetcher::hinted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hinted_;
}

uint64_t LocalPrefetcher::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
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
    bool ok = false;
    Result<FileDescriptor> file = OpenFile(path, O_RDONLY);
    if (file.ok()) ok = ::posix_fadvise(file->fd(), 0, 0, POSIX_FADV_WILLNEED) == 0;
    lock.lock();
    --busy_;
    ++(ok ? hinted_ : failed_);
    if (queue_.empty() && busy_ == 0) idle_.notify_all();
  }
}

}  // namespace fanrun
