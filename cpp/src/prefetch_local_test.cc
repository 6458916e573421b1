// Tests of the local prefetcher: hints reach the kernel, failures are counted, nothing hangs.
#include "fanrun/prefetch_local.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "test_util_internal.h"

namespace fanrun {
namespace {

TEST(LocalPrefetcherTest, HintsEveryFileAndCountsTheMissing) {
  const std::string dir = testing::MakeTempDir("fanrun-prefetch-test");
  ASSERT_FALSE(dir.empty());
  LocalPrefetcher prefetcher(3);
  std::vector<std::string> paths;
  for (int i = 0; i < 20; ++i) {
    paths.push_back(dir + "/f" + std::to_string(i));
    std::ofstream(paths.back()) << std::string(10000, 'p');
  }
  prefetcher.Hint(paths);
  prefetcher.Hint({dir + "/missing"});
  prefetcher.Drain();
  EXPECT_EQ(prefetcher.hinted(), 20u);
  EXPECT_EQ(prefetcher.failed(), 1u);
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
