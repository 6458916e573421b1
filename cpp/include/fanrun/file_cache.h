// FileCache: a node-wide cache directory that a pool of threads fills ahead of use.
//
// Many processes (ranks and their DataLoader workers) open the same directory; each
// file is fetched once. All coordination is through the directory itself with flock
// locks, which the kernel drops when a process dies, so a crash leaves nothing held and
// nothing in /dev/shm:
//   files/<name>     complete files: the only ones ever served, and only as their record says
//   records/<name>   what the cache knows of files/<name> (FileCache::Record, 64 bytes); its
//                    modification time is the file's last use, which orders eviction
//   partial/<name>   a fetch in progress, renamed into files/ once its size is verified
//   locks/<name>     held exclusively while <name> is fetched, verified or evicted
//   usage            bytes in files/, guarded by its own flock; a hint, rebuilt by a scan
// The limit bounds files/; fetches in flight (one per thread) sit in partial/ beside it.
// A file in use holds a shared flock on its files/ entry; eviction takes an exclusive
// one without waiting, so it only ever removes files no process is using.
//
// The directory belongs to the caller (see private_dir.h); every file in it is opened
// relative to a directory descriptor with O_NOFOLLOW, and made 0600, directories 0700.
//
// Each fetch records the file's size and CRC32C, then, once the file is in files/, its
// identity: inode, change time and the boot it was written in. Every open compares the
// open file's fstat with its record: a file whose size, owner or record disagrees is fetched
// again, never served. One whose record holds but whose identity moved is verified (its size
// and CRC32C read again) before it is served: it was re-admitted after a crash (its fetcher
// died between moving it in and confirming its record, or the machine restarted: the cache
// does not fsync), or it was written, truncated or chmod-ed in place, which moves its change time.
#pragma once

#include <sys/stat.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "fanrun/fd.h"
#include "fanrun/private_dir.h"
#include "fanrun/status.h"
#include "fanrun/worker_pool.h"

namespace fanrun {

struct CacheOptions {
  std::string dir;
  uint64_t limit_bytes = 0;  // 0: unbounded
  int threads = 4;
  int attempts = 3;          // tries per file before its error is returned
};

// One file to bring into the cache.
struct CacheItem {
  std::string source;  // what the fetcher reads: a path or a URL
  std::string name;    // its file name in the cache, unique per source
  int64_t size = -1;   // expected bytes, verified after the fetch; -1 when unknown
};

// Asked by a thread that fetches or waits on a caller's behalf, at least every
// kInterruptCheckMs while it waits: a status that is not OK (the cache is closing, or the
// caller was interrupted) makes it give up and return that status.
using Interrupt = std::function<Status()>;
constexpr int kInterruptCheckMs = 100;

// Writes the whole of item.source into partial_path, which the cache has just made, empty and
// private to its owner (opening it again with O_TRUNC keeps its mode), giving up when
// `interrupt` says so. Called on the pool's threads, several at a time.
using Fetcher = std::function<Status(const CacheItem& item, const std::string& partial_path, const Interrupt& interrupt)>;

// Copies a local file: for sources on a slow mount that should be read from local disk. It
// waits on no one, so it does not ask `interrupt`.
Status CopyLocalFile(const CacheItem& item, const std::string& partial_path, const Interrupt& interrupt);

// Writes all of data to a fetcher's partial file; a full filesystem's error says what to do.
Status WriteToCacheFile(int fd, const char* data, size_t size, const std::string& partial_path);

struct CacheStats {
  uint64_t hits = 0;           // found complete in the cache
  uint64_t fetched = 0;        // fetched by this process
  uint64_t bytes_fetched = 0;
  uint64_t retries = 0;        // failed attempts that were tried again
  uint64_t evicted = 0;        // files this process removed to stay under the limit
  uint64_t over_limit = 0;     // times files in use alone exceeded the limit
  uint64_t readmitted = 0;     // files whose identity had moved, served once their checksum verified
  uint64_t rejected = 0;       // files found in the cache but fetched again: size, owner, record or checksum
};

class FileCache {
 public:
  static Result<std::unique_ptr<FileCache>> Open(CacheOptions options, Fetcher fetcher);
  // Stops the threads and joins them; a fetch in progress is given up.
  ~FileCache();
  FileCache(const FileCache&) = delete;
  FileCache& operator=(const FileCache&) = delete;

  // Queues a fetch unless this process already holds or queued the file.
  Status Prefetch(const CacheItem& item);
  // Waits until the file is in the cache and returns its path; it stays in use (never
  // evicted) until Release. A fetch that failed every attempt returns its error. With an
  // `interrupt`, the wait (and a fetch on the caller's thread) ends when it says so.
  Result<std::string> Acquire(const CacheItem& item, const Interrupt& interrupt = nullptr);
  // Ends this process's use of a file, whether it was acquired, prefetched or queued.
  void Release(const std::string& name);
  // Releases every file and drops queued fetches.
  void ReleaseAll();

  CacheStats Stats() const;
  const CacheOptions& options() const { return options_; }
  std::string FilePath(const std::string& name) const;

 private:
  enum class State { kQueued, kFetching, kReady, kFailed };
  struct Entry {
    CacheItem item;
    State state = State::kQueued;
    Status status;
    FileDescriptor pin;     // shared flock on files/<name> while in use
    bool released = false;  // released while a thread was fetching it
  };

  // What records/<name> says of files/<name>; its encoding is in file_cache.cc.
  struct Record {
    uint64_t size = 0;
    uint32_t crc32c = 0;  // of the file's bytes
    uint64_t inode = 0;   // identity: the file the record was confirmed for
    int64_t change_sec = 0;
    int64_t change_nsec = 0;
    std::array<uint8_t, 16> boot{};  // the boot it was confirmed in
  };
  enum class Verdict {
    kMissing,  // nothing in files/, or evicted or replaced while it was opened
    kServe,    // its record holds and its identity has not moved
    kVerify,   // its record holds but its identity moved: read its checksum before serving it
    kReplace,  // not to be served: no record, or a size, owner or type that disagrees
  };
  struct Held {
    FileDescriptor pin;  // shared flock on files/<name>, when there is one
    Verdict verdict = Verdict::kMissing;
    Record record;
    struct stat st = {};
  };
  struct Directories {
    PrivateDirectory root;
    FileDescriptor files, partial, locks, records;
  };

  FileCache(CacheOptions options, Fetcher fetcher, Directories dirs, FileDescriptor usage,
            std::array<uint8_t, 16> boot);
  // Fetches a prefetched file unless it was released or acquired since; on the pool's threads.
  void FetchQueued(const std::string& name);
  // Records the outcome of a fetch; called with mutex_ held.
  void Finish(const std::string& name, Result<FileDescriptor> pin);
  // Brings the file into files/ and returns a descriptor holding its shared flock.
  Result<FileDescriptor> Materialize(const CacheItem& item, const Interrupt& caller_interrupt);
  // Opens files/<name>, takes its shared flock and judges it against its record.
  Result<Held> Inspect(const CacheItem& item) const;
  // Whether a held file still has its record's bytes; if so its record is confirmed anew.
  Result<bool> Verify(const std::string& name, const Held& held);
  // Fetches into partial/, records, moves into files/ and returns the file's pin.
  Result<FileDescriptor> FetchOnce(const CacheItem& item, const Interrupt& interrupt, uint64_t* bytes);
  Status WriteRecord(const std::string& name, const Record& record) const;
  // The closing cache, then the caller's interrupt, if any.
  Status Interrupted(const Interrupt& caller) const;
  // Moves a verified fetch into files/, first evicting least recently used files not in
  // use until `bytes` more fit under the limit.
  Status Commit(const std::string& name, uint64_t bytes);
  // Scans files/ and evicts; returns the bytes left there.
  Result<uint64_t> EvictUntil(uint64_t need);

  const CacheOptions options_;  // its dir as opened: absolute, links resolved
  const Fetcher fetcher_;
  const Directories dirs_;
  const std::array<uint8_t, 16> boot_;

  mutable std::mutex mutex_;
  std::condition_variable entry_done_;
  std::map<std::string, Entry> entries_;
  std::atomic<bool> stopping_{false};  // set under mutex_, read without it by fetches in flight
  CacheStats stats_;

  std::mutex usage_mutex_;  // flock does not exclude threads sharing one descriptor
  FileDescriptor usage_;
  WorkerPool pool_;  // last: its threads stop before the state they use goes
};

}  // namespace fanrun
