// LocalPrefetcher: native threads that ask the kernel to read local files ahead of use.
//
// Local files are read in place, never copied; what a reader gains from prefetching them is
// I/O in flight for the next files while it works on this one, so that a cold disk serves
// several requests at once. Each hint opens the file and calls posix_fadvise(WILLNEED),
// which starts the kernel's readahead of the whole file into the page cache and returns;
// files already cached cost an open and a close. A hint that fails is only counted: the
// reader meets the real error when it opens the file.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fanrun {

class LocalPrefetcher {
 public:
  explicit LocalPrefetcher(int threads);
  // Drops the hints not yet given and joins the threads.
  ~LocalPrefetcher();
  LocalPrefetcher(const LocalPrefetcher&) = delete;
  LocalPrefetcher& operator=(const LocalPrefetcher&) = delete;

  // One hand-over for several files: a single thread wakes for them, not one per file.
  void Hint(std::vector<std::string> paths);
  // Waits until every hint queued so far has been given to the kernel.
  void Drain();

  uint64_t hinted() const;
  uint64_t failed() const;

 private:
  void Run();

  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable idle_;
  std::deque<std::string> queue_;
  int busy_ = 0;
  bool stopping_ = false;
  uint64_t hinted_ = 0;
  uint64_t failed_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace fanrun
