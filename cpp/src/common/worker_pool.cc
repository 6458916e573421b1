// WorkerPool: one queue, one condition variable, threads joined at Stop.
#include "fanrun/worker_pool.h"

#include <utility>

namespace fanrun {

WorkerPool::WorkerPool(int threads, Handler handler) : handler_(std::move(handler)) {
  for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() { Stop(); }

void WorkerPool::Submit(std::string name) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(name));
  }
  work_ready_.notify_one();
}

void WorkerPool::Submit(std::vector<std::string> names) {
  if (names.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& name : names) queue_.push_back(std::move(name));
  }
  work_ready_.notify_one();
}

void WorkerPool::Clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.clear();
}

void WorkerPool::Stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    queue_.clear();
  }
  work_ready_.notify_all();
  for (auto& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

void WorkerPool::Run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const std::string name = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    handler_(name);
    lock.lock();
  }
}

}  // namespace fanrun
