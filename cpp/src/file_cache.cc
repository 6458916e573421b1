// FileCache: fetch threads, cross-process locking and least-recently-used eviction.
#include "fanrun/file_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <utility>

namespace fanrun {
namespace {

Status MakeDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) == 0 || errno == EEXIST) return Status::OK();
  return Status::IOErrorFromErrno(errno, "Failed to create cache directory '", path, "'");
}

// Blocking flock: a wait on the kernel, woken when the holder unlocks or dies. A signal to
// this thread (a caller's Ctrl+C) ends the wait when `interrupt` says so.
Status Lock(int fd, int operation, const std::string& path, const Interrupt& interrupt = nullptr) {
  int rc;
  while ((rc = ::flock(fd, operation)) != 0 && errno == EINTR) {
    FANRUN_RETURN_NOT_OK(interrupt ? interrupt() : Status::OK());
  }
  if (rc != 0) return Status::IOErrorFromErrno(errno, "Failed to lock '", path, "'");
  return Status::OK();
}

bool SameFile(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

Status ValidateName(const std::string& name) {
  if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos) {
    return Status::Invalid("Cache file name '", name, "' must be non-empty, not start with '.' and hold no '/'");
  }
  return Status::OK();
}

// A write that failed because the cache's filesystem is full says what to do about it.
Status CacheWriteError(int err, const std::string& what) {
  Status status = Status::IOErrorFromErrno(err, what);
  if (err == ENOSPC || err == EFBIG || err == EDQUOT) {
    return Status(status.code(), status.message() +
                                     "; the cache's filesystem is full: free space there, lower cache_limit, "
                                     "or choose another cache_dir");
  }
  return status;
}

}  // namespace

Status WriteToCacheFile(int fd, const char* data, size_t size, const std::string& partial_path) {
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return CacheWriteError(errno, internal::StrCat("Failed to write '", partial_path, "'"));
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Status CopyLocalFile(const CacheItem& item, const std::string& partial_path, const Interrupt& /*interrupt*/) {
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor in, OpenFile(item.source, O_RDONLY));
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor out, OpenFile(partial_path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  bool in_kernel = true;  // copy_file_range, until the filesystems say they cannot
  char buffer[1 << 16];
  while (true) {
    ssize_t n;
    if (in_kernel) {
      n = ::copy_file_range(in.fd(), nullptr, out.fd(), nullptr, 1 << 30, 0);
      if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
        in_kernel = false;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return CacheWriteError(errno, internal::StrCat("Failed to copy '", item.source, "' to '", partial_path, "'"));
      if (n == 0) break;
      continue;
    }
    n = ::read(in.fd(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOErrorFromErrno(errno, "Failed to read '", item.source, "'");
    if (n == 0) break;
    FANRUN_RETURN_NOT_OK(WriteToCacheFile(out.fd(), buffer, static_cast<size_t>(n), partial_path));
  }
  return out.Close();
}

Result<std::unique_ptr<FileCache>> FileCache::Open(CacheOptions options, Fetcher fetcher) {
  if (options.dir.empty()) return Status::Invalid("The cache directory must be given");
  if (options.threads < 1) return Status::Invalid("A cache needs at least one thread, not ", options.threads);
  if (options.attempts < 1) return Status::Invalid("A fetch needs at least one attempt, not ", options.attempts);
  for (const char* sub : {"", "/files", "/partial", "/locks"}) {
    FANRUN_RETURN_NOT_OK(MakeDirectory(options.dir + sub));
  }
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor usage, OpenFile(options.dir + "/usage", O_RDWR | O_CREAT, 0644));

  // A fetcher that died left its partial file; nobody holds its lock now, so it goes.
  const std::string partial_dir = options.dir + "/partial";
  if (DIR* dir = ::opendir(partial_dir.c_str())) {
    while (struct dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name == "." || name == "..") continue;
      Result<FileDescriptor> lock = OpenFile(options.dir + "/locks/" + name, O_RDWR | O_CREAT, 0644);
      if (!lock.ok()) continue;
      if (::flock(lock->fd(), LOCK_EX | LOCK_NB) == 0) ::unlinkat(::dirfd(dir), name.c_str(), 0);
    }
    ::closedir(dir);
  }
  std::unique_ptr<FileCache> cache(new FileCache(std::move(options), std::move(fetcher), std::move(usage)));
  return cache;
}

FileCache::FileCache(CacheOptions options, Fetcher fetcher, FileDescriptor usage)
    : options_(std::move(options)), fetcher_(std::move(fetcher)), usage_(std::move(usage)) {
  for (int i = 0; i < options_.threads; ++i) threads_.emplace_back([this] { Run(); });
}

FileCache::~FileCache() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  entry_done_.notify_all();
  for (auto& thread : threads_) thread.join();
}

std::string FileCache::FilePath(const std::string& name) const { return options_.dir + "/files/" + name; }

Status FileCache::Prefetch(const CacheItem& item) {
  FANRUN_RETURN_NOT_OK(ValidateName(item.name));
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, inserted] = entries_.try_emplace(item.name);
  if (!inserted) {
    it->second.released = false;
    return Status::OK();
  }
  it->second.item = item;
  queue_.push_back(item.name);
  work_ready_.notify_one();
  return Status::OK();
}

Result<std::string> FileCache::Acquire(const CacheItem& item, const Interrupt& interrupt) {
  FANRUN_RETURN_NOT_OK(ValidateName(item.name));
  std::unique_lock<std::mutex> lock(mutex_);
  auto [it, inserted] = entries_.try_emplace(item.name);
  if (inserted) it->second.item = item;
  it->second.released = false;
  if (it->second.state == State::kQueued) {
    // Needed now: brought in on the caller's thread, with no hand-over to the pool (a warm
    // hit costs an open and a lock). Its copy in the queue is skipped.
    it->second.state = State::kFetching;
    const CacheItem wanted = it->second.item;
    lock.unlock();
    Result<FileDescriptor> pin = Materialize(wanted, interrupt);
    lock.lock();
    Finish(wanted.name, std::move(pin));
  }
  auto done = [&] {
    auto found = entries_.find(item.name);
    return stopping_ || found == entries_.end() || found->second.state == State::kReady ||
           found->second.state == State::kFailed;
  };
  if (!interrupt) {
    entry_done_.wait(lock, done);
  } else {
    while (!entry_done_.wait_for(lock, std::chrono::milliseconds(kInterruptCheckMs), done)) {
      // Asked without mutex_: it may take the GIL, which a thread waiting for mutex_ may hold.
      lock.unlock();
      Status stop = interrupt();
      lock.lock();
      if (!stop.ok()) return stop;
    }
  }
  it = entries_.find(item.name);
  if (it == entries_.end() || stopping_) return Status::Invalid("The cache of '", options_.dir, "' was closed while '", item.source, "' was awaited");
  if (it->second.state == State::kFailed) {
    Status status = it->second.status;
    entries_.erase(it);  // a later Acquire tries again
    return status;
  }
  return FilePath(item.name);
}

void FileCache::Release(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(name);
  if (it == entries_.end()) return;
  if (it->second.state == State::kFetching) {
    it->second.released = true;  // its thread drops it when the fetch ends
  } else {
    entries_.erase(it);
  }
}

void FileCache::ReleaseAll() {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.clear();
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.state == State::kFetching) {
      it->second.released = true;
      ++it;
    } else {
      it = entries_.erase(it);
    }
  }
}

CacheStats FileCache::Stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void FileCache::Run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const std::string name = queue_.front();
    queue_.pop_front();
    auto it = entries_.find(name);
    if (it == entries_.end() || it->second.state != State::kQueued) continue;
    it->second.state = State::kFetching;
    const CacheItem item = it->second.item;
    lock.unlock();
    Result<FileDescriptor> pin = Materialize(item, nullptr);
    lock.lock();
    Finish(name, std::move(pin));
  }
}

void FileCache::Finish(const std::string& name, Result<FileDescriptor> pin) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return;
  if (it->second.released) {
    entries_.erase(it);  // closing the pin ends the use
    return;
  }
  if (pin.ok()) {
    it->second.pin = std::move(pin).ValueOrDie();
    it->second.state = State::kReady;
  } else {
    it->second.status = pin.status();
    it->second.state = State::kFailed;
  }
  entry_done_.notify_all();
}

Result<FileDescriptor> FileCache::PinIfComplete(const CacheItem& item, bool* found) {
  *found = false;
  const std::string path = FilePath(item.name);
  Result<FileDescriptor> opened = OpenFile(path, O_RDONLY);
  if (!opened.ok()) {
    if (opened.status().code() == StatusCode::kNotFound) return FileDescriptor();
    return opened.status();
  }
  FileDescriptor fd = std::move(opened).ValueOrDie();
  FANRUN_RETURN_NOT_OK(Lock(fd.fd(), LOCK_SH, path));
  // Eviction may have unlinked it between open and lock, or a fetch replaced it.
  struct stat held, named;
  if (::fstat(fd.fd(), &held) != 0) return Status::IOErrorFromErrno(errno, "Failed to stat '", path, "'");
  if (::stat(path.c_str(), &named) != 0 || !SameFile(held, named)) return FileDescriptor();
  // A size that differs from the source's is a file the source has since changed.
  if (item.size >= 0 && held.st_size != item.size) return FileDescriptor();
  // The modification time orders eviction; failing to set it only makes the order coarser.
  (void)::futimens(fd.fd(), nullptr);
  *found = true;
  return fd;
}

Status FileCache::Interrupted(const Interrupt& caller) const {
  if (stopping_) return Status::Invalid("The cache of '", options_.dir, "' is closing");
  return caller ? caller() : Status::OK();
}

Result<FileDescriptor> FileCache::Materialize(const CacheItem& item, const Interrupt& caller_interrupt) {
  const Interrupt interrupted = [this, &caller_interrupt] { return Interrupted(caller_interrupt); };
  bool found = false;
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor pin, PinIfComplete(item, &found));
  if (found) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.hits;
    return pin;
  }
  const std::string lock_path = options_.dir + "/locks/" + item.name;
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor fetch_lock, OpenFile(lock_path, O_RDWR | O_CREAT, 0644));
  FANRUN_RETURN_NOT_OK(Lock(fetch_lock.fd(), LOCK_EX, lock_path, interrupted));
  // Another process may have fetched it while this one waited for the lock.
  FANRUN_ASSIGN_OR_RETURN(pin, PinIfComplete(item, &found));
  if (found) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.hits;
    return pin;
  }
  Status last;
  uint64_t bytes = 0;
  for (int attempt = 1; attempt <= options_.attempts; ++attempt) {
    last = FetchOnce(item, interrupted, &bytes);
    if (last.ok()) break;
    FANRUN_RETURN_NOT_OK(interrupted());  // given up, not failed: no more attempts
    if (attempt < options_.attempts) {
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.retries;
    }
  }
  if (!last.ok()) {
    return Status(last.code(), internal::StrCat("Failed to fetch '", item.source, "' into the cache '", options_.dir,
                                                "' (", options_.attempts, " attempts): ", last.message()));
  }
  // Pinned before the fetch lock is let go, so no one evicts it in between.
  FANRUN_ASSIGN_OR_RETURN(pin, PinIfComplete(item, &found));
  if (!found) return Status::Internal("'", FilePath(item.name), "' vanished right after its fetch");
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.fetched;
  stats_.bytes_fetched += bytes;
  return pin;
}

Status FileCache::FetchOnce(const CacheItem& item, const Interrupt& interrupt, uint64_t* bytes) {
  const std::string partial = options_.dir + "/partial/" + item.name;
  auto fail = [&](Status status) {
    ::unlink(partial.c_str());
    return status;
  };
  Status fetched = fetcher_(item, partial, interrupt);
  if (!fetched.ok()) return fail(fetched);
  struct stat written;
  if (::stat(partial.c_str(), &written) != 0) {
    return fail(Status::IOErrorFromErrno(errno, "The fetch of '", item.source, "' wrote no file '", partial, "'"));
  }
  if (item.size >= 0 && written.st_size != item.size) {
    return fail(Status::IOErrorFromErrno(EIO, "'", item.source, "' gave ", static_cast<int64_t>(written.st_size),
                                         " bytes where ", item.size, " were expected"));
  }
  *bytes = static_cast<uint64_t>(written.st_size);
  Status committed = Commit(partial, FilePath(item.name), *bytes);
  if (!committed.ok()) return fail(committed);
  return Status::OK();
}

Status FileCache::Commit(const std::string& partial, const std::string& final_path, uint64_t bytes) {
  // No fsync: a crash of the process cannot leave a half file under files/, and after a
  // power loss PinIfComplete's size check sends a truncated file back to the source.
  auto move_in = [&]() -> Status {
    if (::rename(partial.c_str(), final_path.c_str()) != 0) {
      return Status::IOErrorFromErrno(errno, "Failed to move '", partial, "' into the cache");
    }
    return Status::OK();
  };
  if (options_.limit_bytes == 0) return move_in();
  // Room is made and the file moved in under one lock, so that the usage file and a scan
  // of files/ never disagree about a file that is half committed.
  std::lock_guard<std::mutex> guard(usage_mutex_);
  const std::string path = options_.dir + "/usage";
  FANRUN_RETURN_NOT_OK(Lock(usage_.fd(), LOCK_EX, path));
  uint64_t used = 0;
  const bool known = ::pread(usage_.fd(), &used, sizeof(used), 0) == static_cast<ssize_t>(sizeof(used));
  Status status;
  if (!known || used + bytes > options_.limit_bytes) {
    Result<uint64_t> scanned = EvictUntil(bytes);
    if (scanned.ok()) {
      used = *scanned;
    } else {
      status = scanned.status();
    }
  }
  if (status.ok()) status = move_in();
  if (status.ok()) {
    used += bytes;
    if (::pwrite(usage_.fd(), &used, sizeof(used), 0) != static_cast<ssize_t>(sizeof(used))) {
      // The file is in; a stale hint only brings the next scan forward or back.
      FANRUN_WARN_NOT_OK(Status::IOErrorFromErrno(errno, "Failed to write '", path, "'"), "cache usage");
    }
  }
  FANRUN_WARN_NOT_OK(Lock(usage_.fd(), LOCK_UN, path), "unlocking the cache's usage file");
  return status;
}

Result<uint64_t> FileCache::EvictUntil(uint64_t need) {
  struct Candidate {
    struct timespec used;
    uint64_t size;
    std::string name;
  };
  const std::string files = options_.dir + "/files";
  DIR* dir = ::opendir(files.c_str());
  if (dir == nullptr) return Status::IOErrorFromErrno(errno, "Failed to list '", files, "'");
  std::vector<Candidate> candidates;
  uint64_t total = 0;
  while (struct dirent* entry = ::readdir(dir)) {
    struct stat st;
    if (entry->d_name[0] == '.' || ::fstatat(::dirfd(dir), entry->d_name, &st, 0) != 0) continue;
    total += static_cast<uint64_t>(st.st_size);
    candidates.push_back({st.st_mtim, static_cast<uint64_t>(st.st_size), entry->d_name});
  }
  const uint64_t limit = options_.limit_bytes;
  const uint64_t goal = limit > need ? limit - need : 0;
  if (total <= goal) {
    ::closedir(dir);
    return total;
  }
  // Down to a tenth below the goal, so that a full cache is not scanned on every fetch.
  const uint64_t low_water = goal > limit / 10 ? goal - limit / 10 : 0;
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.used.tv_sec != b.used.tv_sec ? a.used.tv_sec < b.used.tv_sec : a.used.tv_nsec < b.used.tv_nsec;
  });
  uint64_t evicted = 0;
  for (const Candidate& candidate : candidates) {
    if (total <= low_water) break;
    const int fd = ::openat(::dirfd(dir), candidate.name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    FileDescriptor held(fd);
    // Taken only if no process holds it in use; never waited for.
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;
    struct stat by_fd, by_name;
    if (::fstat(fd, &by_fd) != 0 || ::fstatat(::dirfd(dir), candidate.name.c_str(), &by_name, 0) != 0 ||
        !SameFile(by_fd, by_name)) {
      continue;
    }
    if (::unlinkat(::dirfd(dir), candidate.name.c_str(), 0) == 0) {
      total -= candidate.size;
      ++evicted;
    }
  }
  ::closedir(dir);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.evicted += evicted;
  if (total > goal) ++stats_.over_limit;  // files in use cannot go; the limit is exceeded for now
  return total;
}

}  // namespace fanrun
