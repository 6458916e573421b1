// Tests of the local prefetcher: hints reach the kernel for files not cached, large files are
// read through before their wait returns, cached files are probed now and then, failures are
// counted, nothing hangs.
#include "fanrun/prefetch_local.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

// Writes `count` files of 10 KB under dir.
std::vector<std::string> WriteFiles(const std::string& dir, const std::string& prefix, int count) {
  std::vector<std::string> paths;
  for (int i = 0; i < count; ++i) {
    paths.push_back(dir + "/" + prefix + std::to_string(i));
    std::ofstream(paths.back()) << std::string(10000, 'p');
  }
  return paths;
}

// How many of the file's pages are in the page cache (-1: it cannot be mapped); mincore()
// looks without reading.
int CachedPages(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || st.st_size == 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return -1;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> pages((size + page - 1) / page);
  int cached = -1;
  if (::mincore(map, size, pages.data()) == 0) {
    cached = static_cast<int>(std::count_if(pages.begin(), pages.end(), [](unsigned char p) { return p & 1; }));
  }
  ::munmap(map, size);
  return cached;
}

// Bytes of the file readable from memory alone: read with RWF_NOWAIT, which stops at the first
// page not cached or still being read from the disk.
size_t BytesInMemory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return 0;
  std::vector<char> buffer(1 << 20);
  size_t total = 0;
  while (true) {
    struct iovec iov {buffer.data(), buffer.size()};
    const ssize_t got = ::preadv2(fd, &iov, 1, static_cast<off_t>(total), RWF_NOWAIT);
    if (got <= 0) break;
    total += static_cast<size_t>(got);
  }
  ::close(fd);
  return total;
}

// Drops the files from the page cache, as the data benchmark does for its cold runs; false
// where that is not possible (a tmpfs keeps them).
bool DropFromPageCache(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) return false;
    ::fsync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    if (CachedPages(path) != 0) return false;
  }
  return true;
}

// Hints the paths four at a time, as a reader does, letting each group finish first.
void HintInGroups(LocalPrefetcher& prefetcher, const std::vector<std::string>& paths) {
  for (auto group = paths.begin(); group != paths.end();) {
    const auto end = group + std::min<std::ptrdiff_t>(4, paths.end() - group);
    prefetcher.Hint(std::vector<std::string>(group, end));
    prefetcher.Drain();
    group = end;
  }
}

TEST(LocalPrefetcherTest, FilesNotCachedAreReadAheadAndMissingOnesCounted) {
  const std::string dir = testing::MakeTempDir("fanrun-prefetch-test");
  ASSERT_FALSE(dir.empty());
  const std::vector<std::string> paths = WriteFiles(dir, "f", 20);
  if (!DropFromPageCache(paths)) GTEST_SKIP() << dir << " keeps its files in memory (tmpfs?)";
  LocalPrefetcher prefetcher(3);
  prefetcher.Hint(paths);
  prefetcher.Hint({dir + "/missing"});
  prefetcher.Drain();
  const LocalPrefetcher::Counts counts = prefetcher.counts();
  EXPECT_EQ(counts.hinted, 20u);
  EXPECT_EQ(counts.resident + counts.skipped, 0u);
  EXPECT_EQ(counts.failed, 1u);
  ASSERT_TRUE(testing::RemoveTree(dir));
}

TEST(LocalPrefetcherTest, CachedFilesAreProbedOnlyNowAndThenUntilOneIsNot) {
  const std::string dir = testing::MakeTempDir("fanrun-prefetch-test");
  ASSERT_FALSE(dir.empty());
  const int streak = LocalPrefetcher::kResidentStreak;
  const std::vector<std::string> cached = WriteFiles(dir, "cached", streak + 4 * LocalPrefetcher::kProbeEvery);
  const std::vector<std::string> cold = WriteFiles(dir, "cold", 40);
  if (!DropFromPageCache(cold)) GTEST_SKIP() << dir << " keeps its files in memory (tmpfs?)";
  LocalPrefetcher prefetcher(2);

  HintInGroups(prefetcher, cached);  // just written: in the page cache
  LocalPrefetcher::Counts counts = prefetcher.counts();
  EXPECT_EQ(counts.hinted + counts.failed, 0u);
  EXPECT_EQ(counts.resident, static_cast<uint64_t>(streak + 4));  // the streak, then one probe in 16
  EXPECT_EQ(counts.skipped, cached.size() - counts.resident);

  HintInGroups(prefetcher, cold);  // the first probe that meets one brings every hint back
  counts = prefetcher.counts();
  EXPECT_GE(counts.hinted, cold.size() - LocalPrefetcher::kProbeEvery);
  EXPECT_EQ(counts.resident + counts.skipped + counts.hinted, cached.size() + cold.size());
  ASSERT_TRUE(testing::RemoveTree(dir));
}

TEST(LocalPrefetcherTest, LargeFilesAreReadThroughBeforeTheirWaitReturns) {
  const std::string dir = testing::MakeTempDir("fanrun-prefetch-test");
  ASSERT_FALSE(dir.empty());
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    paths.push_back(dir + "/large" + std::to_string(i));
    std::ofstream(paths.back()) << std::string(LocalPrefetcher::kReadThroughBytes * 3, 'r');
  }
  if (!DropFromPageCache(paths)) GTEST_SKIP() << dir << " keeps its files in memory (tmpfs?)";
  LocalPrefetcher prefetcher(2);
  prefetcher.Wait(dir + "/never-hinted");  // returns at once
  prefetcher.Hint(paths);
  for (const std::string& path : paths) {
    prefetcher.Wait(path);
    // Every byte, read: not only what a readahead would have started.
    EXPECT_EQ(BytesInMemory(path), static_cast<size_t>(LocalPrefetcher::kReadThroughBytes * 3)) << path;
  }
  const LocalPrefetcher::Counts counts = prefetcher.counts();
  EXPECT_EQ(counts.hinted, paths.size());
  EXPECT_EQ(counts.resident + counts.skipped + counts.failed, 0u);
  ASSERT_TRUE(testing::RemoveTree(dir));
}

TEST(LocalPrefetcherTest, ResidentSaysWhetherAFileWasReadWholeIntoThePageCache) {
  const std::string dir = testing::MakeTempDir("fanrun-prefetch-test");
  ASSERT_FALSE(dir.empty());
  const std::vector<std::string> paths = WriteFiles(dir, "f", 1);
  EXPECT_TRUE(LocalPrefetcher::Resident(paths[0]));  // just written
  EXPECT_FALSE(LocalPrefetcher::Resident(dir + "/missing"));
  if (!DropFromPageCache(paths)) GTEST_SKIP() << dir << " keeps its files in memory (tmpfs?)";
  EXPECT_FALSE(LocalPrefetcher::Resident(paths[0]));
  std::ifstream(paths[0]).ignore(1 << 20);  // read whole
  EXPECT_TRUE(LocalPrefetcher::Resident(paths[0]));
  ASSERT_TRUE(testing::RemoveTree(dir));
}

TEST(LocalPrefetcherTest, DestroyingWithHintsQueuedDropsThemAndJoins) {
  auto prefetcher = std::make_unique<LocalPrefetcher>(1);
  for (int i = 0; i < 10000; ++i) prefetcher->Hint({"/nonexistent/fanrun/" + std::to_string(i)});
  prefetcher.reset();  // returns without giving every hint
  SUCCEED();
}

}  // namespace
}  // namespace fanrun
