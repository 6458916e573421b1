// Tests of the node-wide file cache: one fetch per file, verification, eviction, crashes,
// damaged and planted files, and a directory no one else may use.
#include "fanrun/file_cache.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

class FileCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::MakeTempDir("fanrun-cache-test");
    ASSERT_FALSE(root_.empty());
    source_dir_ = root_ + "/source";
    cache_dir_ = root_ + "/cache";
    ASSERT_EQ(::mkdir(source_dir_.c_str(), 0755), 0);
  }
  void TearDown() override { ASSERT_TRUE(testing::RemoveTree(root_)); }

  CacheItem Source(const std::string& name, size_t size, char fill = 'x') {
    const std::string path = source_dir_ + "/" + name;
    std::ofstream(path) << std::string(size, fill);
    return CacheItem{path, name, static_cast<int64_t>(size)};
  }

  std::unique_ptr<FileCache> OpenCache(uint64_t limit, Fetcher fetcher = CopyLocalFile, int attempts = 3) {
    CacheOptions options;
    options.dir = cache_dir_;
    options.limit_bytes = limit;
    options.threads = 2;
    options.attempts = attempts;
    auto cache = FileCache::Open(options, std::move(fetcher));
    EXPECT_TRUE(cache.ok()) << cache.status().message();
    return cache.ok() ? std::move(cache).ValueOrDie() : nullptr;
  }

  std::vector<std::string> Listing(const std::string& sub) {
    std::vector<std::string> names;
    Result<DirectoryListing> listing = DirectoryListing::Open(cache_dir_ + "/" + sub);
    if (!listing.ok()) return names;
    while (const char* name = listing->Next()) {
      if (name[0] != '.') names.push_back(name);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string CachePath(const std::string& sub) const { return cache_dir_ + "/" + sub; }

  // Fetches the item once in a cache of its own, so that it sits complete in files/.
  void Warm(const CacheItem& item) {
    auto cache = OpenCache(0);
    ASSERT_TRUE(cache->Acquire(item).ok());
  }

  static void Overwrite(const std::string& path, const std::string& bytes, int flags = O_WRONLY) {
    const int fd = ::open(path.c_str(), flags);
    ASSERT_GE(fd, 0) << path;
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ::close(fd);
  }

  static mode_t ModeOf(const std::string& path) {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0 ? st.st_mode : 0;
  }

  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::string root_, source_dir_, cache_dir_;
};

TEST_F(FileCacheTest, FetchesOnceAndServesTheSameBytesFromLaterCaches) {
  CacheItem item = Source("a.bin", 5000, 'a');
  {
    auto cache = OpenCache(0);
    auto path = cache->Acquire(item);
    ASSERT_TRUE(path.ok()) << path.status().message();
    EXPECT_EQ(*path, cache_dir_ + "/files/a.bin");
    EXPECT_EQ(Read(*path), std::string(5000, 'a'));
    EXPECT_EQ(cache->Stats().fetched, 1u);
    EXPECT_EQ(cache->Stats().bytes_fetched, 5000u);
  }
  auto again = OpenCache(0);
  ASSERT_TRUE(again->Acquire(item).ok());
  EXPECT_EQ(again->Stats().hits, 1u);
  EXPECT_EQ(again->Stats().fetched, 0u);
}

TEST_F(FileCacheTest, CachesSharingADirectoryFetchEachFileOnce) {
  std::vector<CacheItem> items;
  for (int i = 0; i < 20; ++i) items.push_back(Source("f" + std::to_string(i), 2000));
  std::atomic<int> calls{0};
  Fetcher counting = [&](const CacheItem& item, const std::string& partial, const Interrupt& interrupt) {
    ++calls;
    return CopyLocalFile(item, partial, interrupt);
  };
  // Each cache opens its own descriptors, so their flocks exclude each other as two
  // processes' would.
  auto first = OpenCache(0, counting);
  auto second = OpenCache(0, counting);
  for (const auto& item : items) {
    ASSERT_TRUE(first->Prefetch(item).ok());
    ASSERT_TRUE(second->Prefetch(item).ok());
  }
  for (const auto& item : items) {
    ASSERT_TRUE(first->Acquire(item).ok());
    ASSERT_TRUE(second->Acquire(item).ok());
  }
  EXPECT_EQ(calls.load(), 20);
  EXPECT_EQ(first->Stats().fetched + second->Stats().fetched, 20u);
  EXPECT_EQ(first->Stats().hits + second->Stats().hits, 20u);
}

TEST_F(FileCacheTest, AFailingSourceIsRetriedThenNamedAndLeavesNoFile) {
  CacheItem item{source_dir_ + "/gone.bin", "gone.bin", 10};
  auto cache = OpenCache(0, CopyLocalFile, 3);
  auto path = cache->Acquire(item);
  ASSERT_FALSE(path.ok());
  EXPECT_NE(path.status().message().find(source_dir_ + "/gone.bin"), std::string::npos) << path.status().message();
  EXPECT_NE(path.status().message().find("3 attempts"), std::string::npos) << path.status().message();
  EXPECT_EQ(cache->Stats().retries, 2u);
  EXPECT_TRUE(Listing("files").empty());
  EXPECT_TRUE(Listing("partial").empty());
}

TEST_F(FileCacheTest, AShortFetchIsNeverServed) {
  CacheItem item = Source("short.bin", 100);
  item.size = 200;  // the source promised more than it gave
  auto cache = OpenCache(0, CopyLocalFile, 1);
  auto path = cache->Acquire(item);
  ASSERT_FALSE(path.ok());
  EXPECT_NE(path.status().message().find("gave 100 bytes where 200 were expected"), std::string::npos)
      << path.status().message();
  EXPECT_TRUE(Listing("files").empty());
  EXPECT_TRUE(Listing("partial").empty());
}

TEST_F(FileCacheTest, EvictsTheLeastRecentlyUsedFileThatIsNotInUse) {
  std::vector<CacheItem> items;
  for (const char* name : {"a", "b", "c", "d"}) items.push_back(Source(name, 1000));
  auto cache = OpenCache(3000);
  // a stays in use; b and c are used and let go, b first.
  ASSERT_TRUE(cache->Acquire(items[0]).ok());
  for (int i : {1, 2}) {
    ASSERT_TRUE(cache->Acquire(items[static_cast<size_t>(i)]).ok());
    cache->Release(items[static_cast<size_t>(i)].name);
  }
  ASSERT_TRUE(cache->Acquire(items[3]).ok());
  // The limit forced evictions down to its low-water mark: b (oldest not in use) and c went,
  // a (in use, oldest) stayed.
  EXPECT_EQ(Listing("files"), (std::vector<std::string>{"a", "d"}));
  EXPECT_EQ(cache->Stats().evicted, 2u);
}

TEST_F(FileCacheTest, FilesInUseExceedTheLimitRatherThanBeEvicted) {
  auto cache = OpenCache(1500);
  CacheItem a = Source("a", 1000), b = Source("b", 1000);
  ASSERT_TRUE(cache->Acquire(a).ok());
  ASSERT_TRUE(cache->Acquire(b).ok());
  EXPECT_EQ(Listing("files"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(cache->Stats().over_limit, 1u);
}

TEST_F(FileCacheTest, AFetcherThatDiedLeavesNeitherALockNorAHalfFile) {
  CacheItem item = Source("crash.bin", 4096, 'c');
  ASSERT_EQ(::mkdir(cache_dir_.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((cache_dir_ + "/locks").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((cache_dir_ + "/partial").c_str(), 0755), 0);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Mid-fetch: the lock held and half the bytes written, then killed.
    const int lock = ::open((cache_dir_ + "/locks/crash.bin").c_str(), O_RDWR | O_CREAT, 0644);
    ::flock(lock, LOCK_EX);
    const int partial = ::open((cache_dir_ + "/partial/crash.bin").c_str(), O_WRONLY | O_CREAT, 0644);
    const std::string half(2048, 'c');
    if (::write(partial, half.data(), half.size()) < 0) ::_exit(1);
    if (::write(ready[1], "r", 1) < 0) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  char byte;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status;
  ASSERT_EQ(::waitpid(child, &status, 0), child);

  auto cache = OpenCache(0);
  EXPECT_TRUE(Listing("partial").empty());  // swept at open: its lock died with its fetcher
  auto path = cache->Acquire(item);
  ASSERT_TRUE(path.ok()) << path.status().message();
  EXPECT_EQ(Read(*path), std::string(4096, 'c'));
}

TEST_F(FileCacheTest, ReleasingQueuedFetchesDropsThem) {
  std::atomic<int> calls{0};
  std::vector<CacheItem> items;
  for (int i = 0; i < 50; ++i) items.push_back(Source("q" + std::to_string(i), 10));
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  Fetcher gated = [&](const CacheItem& item, const std::string& partial, const Interrupt& interrupt) {
    ++calls;
    opened.wait();  // both threads hold a fetch here while the rest is still queued
    return CopyLocalFile(item, partial, interrupt);
  };
  auto cache = OpenCache(0, gated);
  for (const auto& item : items) ASSERT_TRUE(cache->Prefetch(item).ok());
  cache->ReleaseAll();
  gate.set_value();
  auto path = cache->Acquire(items[49]);
  ASSERT_TRUE(path.ok()) << path.status().message();
  cache.reset();  // joins the threads
  EXPECT_LE(calls.load(), 3);  // the two in flight, then the one asked for
}

TEST_F(FileCacheTest, RejectsNamesThatLeaveTheCacheDirectory) {
  auto cache = OpenCache(0);
  auto path = cache->Acquire(CacheItem{"/etc/hostname", "../escape", -1});
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.status().code(), StatusCode::kInvalid);
  EXPECT_FALSE(cache->Prefetch(CacheItem{"/etc/hostname", "a/b", -1}).ok());
}

TEST_F(FileCacheTest, ASameSizeCorruptionIsFetchedAgainNotServed) {
  CacheItem item = Source("same.bin", 4000, 's');
  Warm(item);
  Overwrite(CachePath("files/same.bin"), "CORRUPT");  // in place: the size stays 4000
  auto cache = OpenCache(0);
  auto path = cache->Acquire(item);
  ASSERT_TRUE(path.ok()) << path.status().message();
  EXPECT_EQ(Read(*path), std::string(4000, 's'));
  EXPECT_EQ(cache->Stats().rejected, 1u);
  EXPECT_EQ(cache->Stats().fetched, 1u);
}

TEST_F(FileCacheTest, ATruncatedFileIsFetchedAgainWhereTheSourceGaveNoSize) {
  CacheItem item = Source("cut.bin", 20000, 'c');
  item.size = -1;  // as over HTTP, where a listing gives no size
  Warm(item);
  ASSERT_EQ(::truncate(CachePath("files/cut.bin").c_str(), 1000), 0);
  auto cache = OpenCache(0);
  auto path = cache->Acquire(item);
  ASSERT_TRUE(path.ok()) << path.status().message();
  EXPECT_EQ(Read(*path), std::string(20000, 'c'));
  EXPECT_EQ(cache->Stats().rejected, 1u);
}

TEST_F(FileCacheTest, AFileWhoseIdentityMovedIsReadmittedOnceItsChecksumHolds) {
  // The same path as a fetcher that died between moving the file in and confirming its
  // record, or a restart: the record no longer names the file's change time.
  CacheItem item = Source("moved.bin", 3000, 'm');
  Warm(item);
  ASSERT_EQ(::chmod(CachePath("files/moved.bin").c_str(), 0600), 0);  // moves the change time only
  auto cache = OpenCache(0);
  ASSERT_TRUE(cache->Acquire(item).ok());
  EXPECT_EQ(cache->Stats().readmitted, 1u);
  EXPECT_EQ(cache->Stats().fetched, 0u);
  cache->Release(item.name);
  ASSERT_TRUE(cache->Acquire(item).ok());  // its record confirmed: a plain hit now
  EXPECT_EQ(cache->Stats().hits, 1u);
  EXPECT_EQ(cache->Stats().readmitted, 1u);
}

TEST_F(FileCacheTest, AFileWithoutItsRecordIsFetchedAgain) {
  CacheItem item = Source("norecord.bin", 3000, 'n');
  Warm(item);
  ASSERT_EQ(::unlink(CachePath("records/norecord.bin").c_str()), 0);
  auto cache = OpenCache(0);
  ASSERT_TRUE(cache->Acquire(item).ok());
  EXPECT_EQ(cache->Stats().rejected, 1u);
  EXPECT_EQ(cache->Stats().fetched, 1u);
}

TEST_F(FileCacheTest, APlantedFileOfTheRightSizeIsNotServed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to plant a file of another user";
  CacheItem item = Source("planted.bin", 2000, 'p');
  Warm(item);
  // Another user's file in place of the cached one (made by root, then given away).
  const std::string planted = CachePath("files/planted.bin");
  ASSERT_EQ(::unlink(planted.c_str()), 0);
  Overwrite(planted, std::string(2000, 'E'), O_WRONLY | O_CREAT | O_EXCL);
  ASSERT_EQ(::chown(planted.c_str(), 65534, 65534), 0);
  auto cache = OpenCache(0);
  auto path = cache->Acquire(item);
  ASSERT_TRUE(path.ok()) << path.status().message();
  EXPECT_EQ(Read(*path), std::string(2000, 'p'));
  EXPECT_EQ(cache->Stats().rejected, 1u);
}

TEST_F(FileCacheTest, LinksInTheCacheAreNeverFollowed) {
  CacheItem item = Source("linked.bin", 1000, 'l');
  const std::string victim = root_ + "/victim", created = root_ + "/created";
  std::ofstream(victim) << std::string(1000, 'V');  // the right size, to be served if followed
  auto cache = OpenCache(1 << 20);
  // Planted after the cache swept partial/ at open, where a fetch will write.
  ASSERT_EQ(::symlink(victim.c_str(), CachePath("files/linked.bin").c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), CachePath("partial/linked.bin").c_str()), 0);
  ASSERT_EQ(::symlink(created.c_str(), CachePath("locks/linked.bin").c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), CachePath("records/linked.bin").c_str()), 0);
  auto path = cache->Acquire(item);
  ASSERT_TRUE(path.ok()) << path.status().message();
  EXPECT_EQ(Read(*path), std::string(1000, 'l'));
  EXPECT_TRUE(S_ISREG(ModeOf(*path)));
  EXPECT_EQ(Read(victim), std::string(1000, 'V'));
  EXPECT_NE(::access(created.c_str(), F_OK), 0);
}

TEST_F(FileCacheTest, AUsageFileThatIsALinkIsRefusedNotWrittenThrough) {
  const std::string victim = root_ + "/victim";
  std::ofstream(victim) << "untouched";
  ASSERT_EQ(::mkdir(cache_dir_.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(victim.c_str(), CachePath("usage").c_str()), 0);
  CacheOptions options;
  options.dir = cache_dir_;
  options.limit_bytes = 1 << 20;  // the usage file would be written on every commit
  auto cache = FileCache::Open(options, CopyLocalFile);
  ASSERT_FALSE(cache.ok());
  EXPECT_NE(cache.status().message().find("'" + CachePath("usage") + "' is a symbolic link"), std::string::npos)
      << cache.status().message();
  EXPECT_EQ(Read(victim), "untouched");
  EXPECT_TRUE(S_ISLNK(ModeOf(CachePath("usage"))));  // in the directory the caller named: not fanrun's to remove
}

TEST_F(FileCacheTest, EverythingTheCacheMakesIsPrivateWhateverTheUmask) {
  for (mode_t mask : {mode_t{0}, mode_t{022}}) {
    cache_dir_ = root_ + "/cache" + std::to_string(mask);
    CacheItem item = Source("private" + std::to_string(mask), 500);
    ASSERT_EQ(::chmod(item.source.c_str(), 0644), 0);
    const mode_t previous = ::umask(mask);
    {
      auto cache = OpenCache(1 << 20);
      ASSERT_TRUE(cache->Acquire(item).ok());
    }
    ::umask(previous);
    EXPECT_EQ(ModeOf(cache_dir_) & 07777, 0700u);
    for (const char* sub : {"files", "partial", "locks", "records"}) {
      EXPECT_EQ(ModeOf(CachePath(sub)) & 07777, 0700u) << sub;
      for (const std::string& name : Listing(sub)) {
        EXPECT_EQ(ModeOf(CachePath(std::string(sub) + "/" + name)) & 07777, 0600u) << sub << "/" << name;
      }
    }
    EXPECT_EQ(ModeOf(CachePath("usage")) & 07777, 0600u);
  }
}

TEST_F(FileCacheTest, AFetcherThatLeavesAFileOfItsOwnHasItMadePrivate) {
  CacheItem item = Source("own.bin", 300, 'o');
  Fetcher replacing = [&](const CacheItem& wanted, const std::string& partial, const Interrupt&) {
    // Written beside and renamed over, as some fetchers do, with the umask's mode.
    const std::string beside = partial + ".tmp";
    const int fd = ::open(beside.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) return Status::IOErrorFromErrno(errno, "open");
    const std::string bytes = Read(wanted.source);
    const bool written = ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
    ::close(fd);
    if (!written || ::rename(beside.c_str(), partial.c_str()) != 0) return Status::IOError("write");
    return Status::OK();
  };
  auto cache = OpenCache(0, replacing);
  auto path = cache->Acquire(item);
  ASSERT_TRUE(path.ok()) << path.status().message();
  EXPECT_EQ(Read(*path), std::string(300, 'o'));
  EXPECT_EQ(ModeOf(*path) & 07777, 0600u);
}

TEST_F(FileCacheTest, ACacheDirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory away";
  ASSERT_EQ(::mkdir(cache_dir_.c_str(), 0755), 0);
  ASSERT_EQ(::chown(cache_dir_.c_str(), 65534, 65534), 0);
  CacheOptions options;
  options.dir = cache_dir_;
  auto cache = FileCache::Open(options, CopyLocalFile);
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), StatusCode::kUnsafePath);
  EXPECT_NE(cache.status().message().find("The cache directory '" + cache_dir_ + "' belongs to uid 65534"),
            std::string::npos)
      << cache.status().message();
  EXPECT_TRUE(Listing("").empty());  // nothing made in it
}

// A fetch that waits on a server which never answers, as long as nobody interrupts it.
Status NeverAnswers(const CacheItem&, const std::string&, const Interrupt& interrupt) {
  while (true) {
    FANRUN_RETURN_NOT_OK(interrupt());
    std::this_thread::sleep_for(std::chrono::milliseconds(kInterruptCheckMs));
  }
}

TEST_F(FileCacheTest, AnInterruptEndsTheWaitForAFetchOnThePool) {
  auto cache = OpenCache(0, NeverAnswers);
  const CacheItem item{"http://nowhere/a", "a", -1};
  ASSERT_TRUE(cache->Prefetch(item).ok());
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  auto path = cache->Acquire(item, [&] { return seconds() > 0.3 ? Status::Invalid("interrupted") : Status::OK(); });
  EXPECT_LT(seconds(), 0.3 + 3 * kInterruptCheckMs / 1000.0);
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.status().message(), "interrupted");
  cache.reset();  // the fetch on the pool is given up: the threads join at once
  EXPECT_LT(seconds(), 1.0);
}

TEST_F(FileCacheTest, AnInterruptedFetchOnTheCallersThreadIsNotTriedAgain) {
  std::atomic<int> calls{0};
  Fetcher counted = [&](const CacheItem& item, const std::string& partial, const Interrupt& interrupt) {
    ++calls;
    return NeverAnswers(item, partial, interrupt);
  };
  auto cache = OpenCache(0, counted, 3);
  auto path = cache->Acquire(CacheItem{"http://nowhere/b", "b", -1}, [] { return Status::Invalid("interrupted"); });
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.status().message(), "interrupted");
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(Listing("partial").empty());
}

}  // namespace
}  // namespace fanrun
