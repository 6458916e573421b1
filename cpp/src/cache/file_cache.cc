// FileCache: fetch threads, cross-process locking and least-recently-used eviction.
#include "fanrun/file_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "fanrun/checkpoint_crc32c.h"

namespace fanrun {
namespace {

constexpr size_t kRecordBytes = 64;
constexpr char kRecordMagic[8] = {'f', 'a', 'n', 'r', 'e', 'c', '0', '1'};

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

// Opens a lock or a record in one of the cache's own subdirectories. A link found in its place
// is removed, never followed: nothing fanrun makes there is a link, and no fanrun process can
// hold a lock through one.
Result<FileDescriptor> OpenInDirectory(int dir, const std::string& dir_path, const std::string& name, int flags) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    int fd;
    do {
      fd = ::openat(dir, name.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, 0600);
    } while (fd < 0 && errno == EINTR);
    if (fd >= 0) return FileDescriptor(fd);
    if (errno != ELOOP || attempt > 0 || ::unlinkat(dir, name.c_str(), 0) != 0) break;
  }
  const int err = errno;
  if (err == ENOENT) return Status::NotFound("'", dir_path, "/", name, "' does not exist");
  return CacheWriteError(err, internal::StrCat("Failed to open '", dir_path, "/", name, "'"));
}

// The id of this boot: a record confirmed in another boot is verified before it is served,
// since the cache does not fsync and a machine that stopped may not have written its bytes.
std::array<uint8_t, 16> ReadBootId() {
  std::array<uint8_t, 16> id{};
  Result<FileDescriptor> fd = OpenFile("/proc/sys/kernel/random/boot_id", O_RDONLY);
  if (!fd.ok()) return id;  // no procfs: a restart goes unnoticed, sizes are still checked
  char text[64];
  const ssize_t n = ::read(fd->fd(), text, sizeof(text));
  size_t nibble = 0;
  for (ssize_t i = 0; i < n && nibble < 32; ++i) {
    const char c = text[i];
    int value = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (value < 0) continue;
    id[nibble / 2] = static_cast<uint8_t>(id[nibble / 2] | (nibble % 2 == 0 ? value << 4 : value));
    ++nibble;
  }
  return id;
}

// CRC32C of the first `size` bytes of an open file.
Result<uint32_t> ChecksumOf(int fd, uint64_t size, const std::string& path) {
  std::vector<char> buffer(static_cast<size_t>(std::min<uint64_t>(std::max<uint64_t>(size, 1), 1 << 20)));
  uint32_t crc = 0;
  for (uint64_t done = 0; done < size;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buffer.size(), size - done));
    const ssize_t n = ::pread(fd, buffer.data(), want, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOErrorFromErrno(errno, "Failed to read '", path, "'");
    if (n == 0) return Status::DataLoss("'", path, "' ended after ", done, " of its ", size, " bytes");
    crc = Crc32c(crc, buffer.data(), static_cast<size_t>(n));
    done += static_cast<uint64_t>(n);
  }
  return crc;
}

template <typename T>
void Put(char* out, size_t offset, T value) {
  std::memcpy(out + offset, &value, sizeof(value));
}

template <typename T>
T Get(const char* in, size_t offset) {
  T value;
  std::memcpy(&value, in + offset, sizeof(value));
  return value;
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
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor out, OpenFile(partial_path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, 0600));
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
  const DirectoryDescription described{"The cache directory",
                                       "Use a directory that belongs to you and that only you can write."};
  FANRUN_ASSIGN_OR_RETURN(PrivateDirectory root, OpenPrivateDirectory(options.dir, described));
  Directories dirs{std::move(root), {}, {}, {}, {}};
  FANRUN_ASSIGN_OR_RETURN(dirs.files, OpenPrivateSubdirectory(dirs.root, "files", described));
  FANRUN_ASSIGN_OR_RETURN(dirs.partial, OpenPrivateSubdirectory(dirs.root, "partial", described));
  FANRUN_ASSIGN_OR_RETURN(dirs.locks, OpenPrivateSubdirectory(dirs.root, "locks", described));
  FANRUN_ASSIGN_OR_RETURN(dirs.records, OpenPrivateSubdirectory(dirs.root, "records", described));
  // The usage file sits in the directory the caller named, where a link may be the caller's
  // own: refused, neither followed nor removed.
  const int usage = ::openat(dirs.root.fd.fd(), "usage", O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (usage < 0) {
    if (errno == ELOOP) {
      return Status::Invalid("'", dirs.root.path, "/usage' is a symbolic link, which the cache does not follow: "
                             "remove it, or use another cache directory");
    }
    return CacheWriteError(errno, internal::StrCat("Failed to open '", dirs.root.path, "/usage'"));
  }
  options.dir = dirs.root.path;

  // A fetcher that died left its partial file; nobody holds its lock now, so it goes.
  Result<DirectoryListing> partial = DirectoryListing::OpenAt(dirs.partial.fd(), options.dir + "/partial");
  if (partial.ok()) {
    while (const char* entry = partial->Next()) {
      const std::string name = entry;
      if (name[0] == '.') continue;
      Result<FileDescriptor> lock = OpenInDirectory(dirs.locks.fd(), options.dir + "/locks", name, O_RDWR | O_CREAT);
      if (!lock.ok()) continue;
      if (::flock(lock->fd(), LOCK_EX | LOCK_NB) == 0) ::unlinkat(dirs.partial.fd(), name.c_str(), 0);
    }
  }
  std::unique_ptr<FileCache> cache(
      new FileCache(std::move(options), std::move(fetcher), std::move(dirs), FileDescriptor(usage), ReadBootId()));
  return cache;
}

FileCache::FileCache(CacheOptions options, Fetcher fetcher, Directories dirs, FileDescriptor usage,
                     std::array<uint8_t, 16> boot)
    : options_(std::move(options)),
      fetcher_(std::move(fetcher)),
      dirs_(std::move(dirs)),
      boot_(boot),
      usage_(std::move(usage)),
      pool_(options_.threads, [this](const std::string& name) { FetchQueued(name); }) {}

FileCache::~FileCache() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  entry_done_.notify_all();
  pool_.Stop();
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
  pool_.Submit(item.name);
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
  pool_.Clear();
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

void FileCache::FetchQueued(const std::string& name) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_) return;
  auto it = entries_.find(name);
  // Released since, or taken by an Acquire on the caller's thread.
  if (it == entries_.end() || it->second.state != State::kQueued) return;
  it->second.state = State::kFetching;
  const CacheItem item = it->second.item;
  lock.unlock();
  Result<FileDescriptor> pin = Materialize(item, nullptr);
  lock.lock();
  Finish(name, std::move(pin));
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

Result<FileCache::Held> FileCache::Inspect(const CacheItem& item) const {
  Held held;
  const std::string path = FilePath(item.name);
  // O_NONBLOCK: a FIFO in its place must not stop the open; it is judged below like any other.
  int fd;
  do {
    fd = ::openat(dirs_.files.fd(), item.name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    if (errno == ENOENT) return held;
    if (errno == ELOOP) {  // a link: never followed, replaced by the fetch
      held.verdict = Verdict::kReplace;
      return held;
    }
    return Status::IOErrorFromErrno(errno, "Failed to open '", path, "'");
  }
  held.pin = FileDescriptor(fd);
  FANRUN_RETURN_NOT_OK(Lock(fd, LOCK_SH, path));
  if (::fstat(fd, &held.st) != 0) return Status::IOErrorFromErrno(errno, "Failed to stat '", path, "'");
  // Eviction may have unlinked it between open and lock, or a fetch renamed another over it:
  // either leaves it with no link, as nothing in files/ is ever linked twice or renamed.
  if (held.st.st_nlink == 0) {
    held.pin = FileDescriptor();
    return held;
  }
  held.verdict = Verdict::kReplace;
  if (!S_ISREG(held.st.st_mode) || held.st.st_uid != ::geteuid()) return held;
  // A size that differs from the source's is a file the source has since changed.
  if (item.size >= 0 && held.st.st_size != item.size) return held;

  Result<FileDescriptor> opened = OpenInDirectory(dirs_.records.fd(), options_.dir + "/records", item.name, O_RDONLY | O_NONBLOCK);
  if (!opened.ok()) return held;  // no record, nothing to hold the file to
  char bytes[kRecordBytes + 1];
  ssize_t n;
  do {
    n = ::read(opened->fd(), bytes, sizeof(bytes));
  } while (n < 0 && errno == EINTR);
  // A record being written (or cut short by a crash) reads short: judged again under the fetch lock.
  if (n != static_cast<ssize_t>(kRecordBytes) || std::memcmp(bytes, kRecordMagic, sizeof(kRecordMagic)) != 0 ||
      Get<uint32_t>(bytes, 60) != Crc32c(0, bytes, 60)) {
    return held;
  }
  Record& record = held.record;
  record.size = Get<uint64_t>(bytes, 8);
  record.inode = Get<uint64_t>(bytes, 16);
  record.change_sec = Get<int64_t>(bytes, 24);
  record.change_nsec = Get<int64_t>(bytes, 32);
  std::memcpy(record.boot.data(), bytes + 40, record.boot.size());
  record.crc32c = Get<uint32_t>(bytes, 56);
  if (record.size != static_cast<uint64_t>(held.st.st_size)) return held;
  // Any write, truncation or chmod moves the change time, which no user can set back.
  const bool same = record.inode == static_cast<uint64_t>(held.st.st_ino) && record.change_sec == held.st.st_ctim.tv_sec &&
                    record.change_nsec == held.st.st_ctim.tv_nsec && record.boot == boot_;
  held.verdict = same ? Verdict::kServe : Verdict::kVerify;
  // The record's modification time is the file's last use; touching the file itself would
  // move its change time. Failing to set it only makes the eviction order coarser.
  if (same) (void)::futimens(opened->fd(), nullptr);
  return held;
}

Status FileCache::WriteRecord(const std::string& name, const Record& record) const {
  char bytes[kRecordBytes] = {};
  std::memcpy(bytes, kRecordMagic, sizeof(kRecordMagic));
  Put(bytes, 8, record.size);
  Put(bytes, 16, record.inode);
  Put(bytes, 24, record.change_sec);
  Put(bytes, 32, record.change_nsec);
  std::memcpy(bytes + 40, record.boot.data(), record.boot.size());
  Put(bytes, 56, record.crc32c);
  Put(bytes, 60, Crc32c(0, bytes, 60));
  const std::string path = options_.dir + "/records/" + name;
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor fd, OpenInDirectory(dirs_.records.fd(), options_.dir + "/records", name,
                                                             O_WRONLY | O_CREAT | O_TRUNC));
  FANRUN_RETURN_NOT_OK(WriteToCacheFile(fd.fd(), bytes, sizeof(bytes), path));
  return fd.Close();
}

Result<bool> FileCache::Verify(const std::string& name, const Held& held) {
  Result<uint32_t> crc = ChecksumOf(held.pin.fd(), held.record.size, FilePath(name));
  if (!crc.ok() && crc.status().code() == StatusCode::kDataLoss) return false;  // cut short since its fstat
  if (!crc.ok()) return crc.status();
  if (*crc != held.record.crc32c) return false;
  Record confirmed = held.record;
  confirmed.inode = static_cast<uint64_t>(held.st.st_ino);
  confirmed.change_sec = held.st.st_ctim.tv_sec;
  confirmed.change_nsec = held.st.st_ctim.tv_nsec;
  confirmed.boot = boot_;
  FANRUN_RETURN_NOT_OK(WriteRecord(name, confirmed));
  return true;
}

Status FileCache::Interrupted(const Interrupt& caller) const {
  if (stopping_) return Status::Invalid("The cache of '", options_.dir, "' is closing");
  return caller ? caller() : Status::OK();
}

Result<FileDescriptor> FileCache::Materialize(const CacheItem& item, const Interrupt& caller_interrupt) {
  const Interrupt interrupted = [this, &caller_interrupt] { return Interrupted(caller_interrupt); };
  FANRUN_ASSIGN_OR_RETURN(Held held, Inspect(item));
  if (held.verdict == Verdict::kServe) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.hits;
    return std::move(held.pin);
  }
  held = Held();  // its shared lock is let go before waiting for the fetch lock
  const std::string lock_path = options_.dir + "/locks/" + item.name;
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor fetch_lock,
                          OpenInDirectory(dirs_.locks.fd(), options_.dir + "/locks", item.name, O_RDWR | O_CREAT));
  FANRUN_RETURN_NOT_OK(Lock(fetch_lock.fd(), LOCK_EX, lock_path, interrupted));
  // Another process may have fetched or verified it while this one waited for the lock.
  FANRUN_ASSIGN_OR_RETURN(held, Inspect(item));
  if (held.verdict == Verdict::kServe) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.hits;
    return std::move(held.pin);
  }
  if (held.verdict == Verdict::kVerify) {
    FANRUN_ASSIGN_OR_RETURN(bool intact, Verify(item.name, held));
    if (intact) {
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.readmitted;
      return std::move(held.pin);
    }
  }
  if (held.verdict != Verdict::kMissing) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.rejected;
  }
  held = Held();
  Status last;
  uint64_t bytes = 0;
  FileDescriptor pin;
  for (int attempt = 1; attempt <= options_.attempts; ++attempt) {
    Result<FileDescriptor> fetched = FetchOnce(item, interrupted, &bytes);
    last = fetched.status();
    if (last.ok()) {
      pin = std::move(fetched).ValueOrDie();
      break;
    }
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
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.fetched;
  stats_.bytes_fetched += bytes;
  return pin;
}

Result<FileDescriptor> FileCache::FetchOnce(const CacheItem& item, const Interrupt& interrupt, uint64_t* bytes) {
  const int partial_dir = dirs_.partial.fd();
  const char* name = item.name.c_str();
  const std::string partial = options_.dir + "/partial/" + item.name;
  auto fail = [&](Status status) {
    ::unlinkat(partial_dir, name, 0);
    return status;
  };
  // The cache makes the file the fetcher writes: whatever a dead fetcher (or anyone) left in
  // its place goes first, so that no fetcher ever writes through a link or into another's file.
  if (::unlinkat(partial_dir, name, 0) != 0 && errno != ENOENT) {
    return Status::IOErrorFromErrno(errno, "Failed to clear '", partial, "'");
  }
  int made;
  do {
    made = ::openat(partial_dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  } while (made < 0 && errno == EINTR);
  if (made < 0) return CacheWriteError(errno, internal::StrCat("Failed to create '", partial, "'"));
  FANRUN_RETURN_NOT_OK(FileDescriptor(made).Close());

  Status fetched = fetcher_(item, partial, interrupt);
  if (!fetched.ok()) return fail(fetched);
  int fd;
  do {
    fd = ::openat(partial_dir, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    return fail(Status::IOErrorFromErrno(errno, "The fetch of '", item.source, "' left no file '", partial, "'"));
  }
  FileDescriptor file(fd);
  struct stat written;
  if (::fstat(fd, &written) != 0) return fail(Status::IOErrorFromErrno(errno, "Failed to stat '", partial, "'"));
  if (!S_ISREG(written.st_mode) || written.st_uid != ::geteuid()) {
    return fail(Status::IOError("The fetch of '", item.source, "' left '", partial, "' that is not a file of this user"));
  }
  // A fetcher that wrote a file of its own in place of the cache's may have left it readable.
  if ((written.st_mode & 07777) != 0600 && ::fchmod(fd, 0600) != 0) {
    return fail(Status::IOErrorFromErrno(errno, "Failed to chmod '", partial, "'"));
  }
  if (item.size >= 0 && written.st_size != item.size) {
    return fail(Status::IOErrorFromErrno(EIO, "'", item.source, "' gave ", static_cast<int64_t>(written.st_size),
                                         " bytes where ", item.size, " were expected"));
  }
  *bytes = static_cast<uint64_t>(written.st_size);
  Result<uint32_t> crc = ChecksumOf(fd, *bytes, partial);
  if (!crc.ok()) return fail(crc.status());
  // Recorded before the move, with the identity the file has here: a process that dies
  // before confirming it below leaves a file that is verified by its checksum, then served.
  Record record{*bytes, *crc, static_cast<uint64_t>(written.st_ino), written.st_ctim.tv_sec, written.st_ctim.tv_nsec, boot_};
  Status status = WriteRecord(item.name, record);
  // In use from before its move, so that no eviction takes it before its reader has it.
  if (status.ok()) status = Lock(fd, LOCK_SH, partial);
  if (status.ok()) status = Commit(item.name, *bytes);
  if (!status.ok()) return fail(status);
  // The move gave it a new change time: that is the identity confirmed.
  if (::fstat(fd, &written) != 0) return Status::IOErrorFromErrno(errno, "Failed to stat '", FilePath(item.name), "'");
  record.change_sec = written.st_ctim.tv_sec;
  record.change_nsec = written.st_ctim.tv_nsec;
  FANRUN_RETURN_NOT_OK(WriteRecord(item.name, record));
  return file;
}

Status FileCache::Commit(const std::string& name, uint64_t bytes) {
  // No fsync: a crash of the process cannot leave a half file under files/, and after a
  // restart each file's record (written in another boot) has it verified before it is served.
  auto move_in = [&]() -> Status {
    if (::renameat(dirs_.partial.fd(), name.c_str(), dirs_.files.fd(), name.c_str()) != 0) {
      return Status::IOErrorFromErrno(errno, "Failed to move '", options_.dir, "/partial/", name, "' into the cache");
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
  const int files = dirs_.files.fd();
  FANRUN_ASSIGN_OR_RETURN(DirectoryListing listing, DirectoryListing::OpenAt(files, options_.dir + "/files"));
  std::vector<Candidate> candidates;
  uint64_t total = 0;
  while (const char* name = listing.Next()) {
    struct stat st, record;
    if (name[0] == '.' || ::fstatat(files, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
    total += static_cast<uint64_t>(st.st_size);
    // Last used when its record was last touched; a file without one goes first.
    const bool recorded = ::fstatat(dirs_.records.fd(), name, &record, AT_SYMLINK_NOFOLLOW) == 0;
    candidates.push_back({recorded ? record.st_mtim : timespec{0, 0}, static_cast<uint64_t>(st.st_size), name});
  }
  const uint64_t limit = options_.limit_bytes;
  const uint64_t goal = limit > need ? limit - need : 0;
  if (total <= goal) return total;
  // Down to a tenth below the goal, so that a full cache is not scanned on every fetch.
  const uint64_t low_water = goal > limit / 10 ? goal - limit / 10 : 0;
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.used.tv_sec != b.used.tv_sec ? a.used.tv_sec < b.used.tv_sec : a.used.tv_nsec < b.used.tv_nsec;
  });
  uint64_t evicted = 0;
  for (const Candidate& candidate : candidates) {
    if (total <= low_water) break;
    const char* name = candidate.name.c_str();
    // Its fetch lock, so that no fetch or verification of the same name is under way; then
    // the file's own, taken only if no process holds it in use. Neither is waited for.
    Result<FileDescriptor> fetch_lock = OpenInDirectory(dirs_.locks.fd(), options_.dir + "/locks", candidate.name, O_RDWR | O_CREAT);
    if (!fetch_lock.ok() || ::flock(fetch_lock->fd(), LOCK_EX | LOCK_NB) != 0) continue;
    const int fd = ::openat(files, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    FileDescriptor held(fd);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;
    struct stat by_fd, by_name;
    if (::fstat(fd, &by_fd) != 0 || ::fstatat(files, name, &by_name, AT_SYMLINK_NOFOLLOW) != 0 ||
        !SameFile(by_fd, by_name)) {
      continue;
    }
    if (::unlinkat(files, name, 0) == 0) {
      ::unlinkat(dirs_.records.fd(), name, 0);
      total -= candidate.size;
      ++evicted;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.evicted += evicted;
  if (total > goal) ++stats_.over_limit;  // files in use cannot go; the limit is exceeded for now
  return total;
}

}  // namespace fanrun
