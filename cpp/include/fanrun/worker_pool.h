// WorkerPool: native threads that take names off one queue and hand each to one handler.
//
// The file cache and the local prefetcher each keep their own state under their own mutex;
// the pool only queues and wakes. It never holds its lock while the handler runs, so a
// handler may take its owner's mutex, and an owner may submit or clear with its mutex held.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fanrun {

class WorkerPool {
 public:
  using Handler = std::function<void(const std::string& name)>;

  // Starts `threads` threads (at least one), each running `handler` on one name at a time.
  WorkerPool(int threads, Handler handler);
  // Stop().
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues one name and wakes one thread.
  void Submit(std::string name);
  // Queues several names and wakes one thread for them all: the others stay asleep unless
  // more work comes, so that a batch costs its owner's readers one thread's CPU.
  void Submit(std::vector<std::string> names);
  // Drops the names not yet taken; a handler already running goes on.
  void Clear();
  // Drops the names not yet taken and joins the threads, once the handlers running now have
  // returned: an owner that wants them to give up early says so first. Idempotent.
  void Stop();

 private:
  void Run();

  const Handler handler_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::deque<std::string> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace fanrun
