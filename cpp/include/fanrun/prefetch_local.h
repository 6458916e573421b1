// LocalPrefetcher: native threads that ask the kernel to read local files ahead of use.
//
// Local files are read in place, never copied; what a reader gains from prefetching them is
// I/O in flight for the next files while it works on this one, so that a cold disk serves
// several requests at once. Each hint opens the file and, unless its last page is already
// in the page cache:
// - a file of kReadThroughBytes or more is read through with sendfile() to /dev/null, which
//   fills the page cache and copies nothing; its reader waits for that (Wait) and then reads
//   from memory. With 8 readers of 10 MB files on a cold virtio disk, posix_fadvise(WILLNEED)
//   or a reader's own read() of the whole file had the disk serve requests of about 1 MB;
//   read through first, about 2 MB, and faster in five tries of six, by up to 20 %
//   (benchmarks/read_through.py);
// - a smaller file gets posix_fadvise(WILLNEED), which starts the kernel's readahead of the
//   whole file and returns.
// A hint that fails is only counted: the reader meets the real error when it opens the file.
//
// Files already in the page cache gain nothing, and on a busy machine the threads' work for
// them costs the readers CPU. So once kResidentStreak files in a row were found cached, only
// one hint in kProbeEvery is given, as a probe; the first probe that finds a file not cached
// brings every hint back.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "fanrun/fd.h"
#include "fanrun/worker_pool.h"

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
  // Waits until the hints queued so far for `path` have been given: for a large file, until
  // it was read through, so that its reader finds it in the page cache.
  void Wait(const std::string& path);

  struct Counts {
    uint64_t hinted = 0;    // read through, or readahead started
    uint64_t resident = 0;  // already in the page cache: nothing to do
    uint64_t skipped = 0;   // not looked at: the files before were all cached
    uint64_t failed = 0;    // could not be opened
  };
  Counts counts() const;

  // Whether the file at `path` was read whole into the page cache: its last page is there.
  // False where it cannot be opened.
  static bool Resident(const std::string& path);

  static constexpr int kResidentStreak = 32;
  static constexpr int kProbeEvery = 16;
  static constexpr off_t kReadThroughBytes = 1 << 20;
  static constexpr size_t kReadThroughStep = 4 << 20;  // per sendfile(): stopping is seen between steps

 private:
  // Gives one hint to the kernel; run on the pool's threads.
  void Give(const std::string& path);
  bool ReadThrough(int fd, off_t size);

  mutable std::mutex mutex_;
  std::condition_variable given_;  // a hint was given; Wait() and Drain() look again
  std::unordered_map<std::string, int> pending_;  // hints queued or being given, per path
  std::atomic<bool> stopping_{false};
  int resident_streak_ = 0;    // files found cached in a row
  uint64_t since_probe_ = 0;   // hints dropped since the last probe, while the streak holds
  Counts counts_;
  FileDescriptor null_;  // /dev/null, where read-through copies nothing
  WorkerPool pool_;      // last: its threads stop before the state they use goes
};

}  // namespace fanrun
