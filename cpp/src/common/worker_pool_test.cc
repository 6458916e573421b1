// Tests of the worker pool: every name is handled once, threads run side by side, Clear drops
// what no thread has taken, Stop waits for the handlers running.
#include "fanrun/worker_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fanrun {
namespace {

// A generous bound on every wait, so that a broken pool fails its test instead of hanging it.
constexpr auto kHang = std::chrono::seconds(30);

// What the handlers did, and a gate that holds them until the test opens it.
class Recorder {
 public:
  WorkerPool::Handler Handler() {
    return [this](const std::string& name) {
      std::unique_lock<std::mutex> lock(mutex_);
      ++running_;
      started_.push_back(name);
      changed_.notify_all();
      changed_.wait(lock, [this] { return open_; });
      --running_;
      ++handled_[name];
      changed_.notify_all();
    };
  }

  void Open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }

  // Waits until `count` handlers have run to their end.
  bool AwaitHandled(size_t count) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kHang, [&] { return Total() >= count; });
  }

  // Waits until `count` handlers are running at once.
  bool AwaitRunning(int count) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kHang, [&] { return running_ >= count; });
  }

  std::map<std::string, int> handled() {
    std::lock_guard<std::mutex> lock(mutex_);
    return handled_;
  }

  std::vector<std::string> started() {
    std::lock_guard<std::mutex> lock(mutex_);
    return started_;
  }

 private:
  size_t Total() const {
    size_t total = 0;
    for (const auto& [name, times] : handled_) total += static_cast<size_t>(times);
    return total;
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = false;
  int running_ = 0;
  std::vector<std::string> started_;
  std::map<std::string, int> handled_;
};

TEST(WorkerPoolTest, HandlesEveryNameOnce) {
  Recorder recorder;
  recorder.Open();
  WorkerPool pool(3, recorder.Handler());
  std::vector<std::string> batch;
  for (int i = 0; i < 50; ++i) pool.Submit("single" + std::to_string(i));
  for (int i = 0; i < 50; ++i) batch.push_back("batch" + std::to_string(i));
  pool.Submit(std::move(batch));
  ASSERT_TRUE(recorder.AwaitHandled(100));
  const std::map<std::string, int> handled = recorder.handled();
  EXPECT_EQ(handled.size(), 100u);
  for (const auto& [name, times] : handled) EXPECT_EQ(times, 1) << name;
}

TEST(WorkerPoolTest, ThreadsRunSideBySide) {
  Recorder recorder;
  WorkerPool pool(2, recorder.Handler());
  pool.Submit("a");
  pool.Submit("b");
  // Both handlers are held by the gate: only two threads at once can have started them.
  EXPECT_TRUE(recorder.AwaitRunning(2));
  recorder.Open();
  EXPECT_TRUE(recorder.AwaitHandled(2));
}

TEST(WorkerPoolTest, OneThreadTakesNamesInOrder) {
  Recorder recorder;
  recorder.Open();
  WorkerPool pool(1, recorder.Handler());
  pool.Submit(std::vector<std::string>{"first", "second"});
  pool.Submit("third");
  ASSERT_TRUE(recorder.AwaitHandled(3));
  EXPECT_EQ(recorder.started(), (std::vector<std::string>{"first", "second", "third"}));
}

TEST(WorkerPoolTest, ClearDropsWhatNoThreadHasTaken) {
  Recorder recorder;
  WorkerPool pool(1, recorder.Handler());
  pool.Submit("running");
  ASSERT_TRUE(recorder.AwaitRunning(1));
  pool.Submit(std::vector<std::string>{"dropped1", "dropped2"});
  pool.Clear();
  pool.Submit("after");
  recorder.Open();
  // One thread takes names in order: had the dropped ones stayed, they would come before this.
  ASSERT_TRUE(recorder.AwaitHandled(2));
  EXPECT_EQ(recorder.started(), (std::vector<std::string>{"running", "after"}));
}

TEST(WorkerPoolTest, StopWaitsForTheHandlerRunning) {
  Recorder recorder;
  WorkerPool pool(1, recorder.Handler());
  pool.Submit("running");
  ASSERT_TRUE(recorder.AwaitRunning(1));
  std::thread opener([&recorder] { recorder.Open(); });
  pool.Stop();
  opener.join();
  EXPECT_EQ(recorder.handled(), (std::map<std::string, int>{{"running", 1}}));
  pool.Stop();  // a second time, and the destructor's, do nothing
}

TEST(WorkerPoolTest, AtLeastOneThread) {
  Recorder recorder;
  recorder.Open();
  WorkerPool pool(0, recorder.Handler());
  pool.Submit("name");
  EXPECT_TRUE(recorder.AwaitHandled(1));
}

}  // namespace
}  // namespace fanrun
