// Tests of atomic publication: a new target, a swap with an existing one, errors.
#include "fanrun/checkpoint_publish.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

class PublishTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::MakeTempDir("fanrun-publish");
    ASSERT_FALSE(root_.empty());
  }
  void TearDown() override { ASSERT_TRUE(testing::RemoveTree(root_)); }

  std::string MakeCheckpoint(const std::string& name, const std::string& content) {
    const std::string dir = root_ + "/" + name;
    EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0);
    std::ofstream(dir + "/data") << content;
    return dir;
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::string root_;
};

TEST_F(PublishTest, NewTargetIsRenamedInPlace) {
  const std::string staging = MakeCheckpoint(".step_1.partial", "one");
  auto previous = PublishDirectory(staging, root_ + "/step_1");
  ASSERT_TRUE(previous.ok()) << previous.status().message();
  EXPECT_EQ(*previous, "");
  EXPECT_EQ(Read(root_ + "/step_1/data"), "one");
  EXPECT_NE(::access(staging.c_str(), F_OK), 0);
}

TEST_F(PublishTest, ExistingTargetIsSwappedAndThePreviousOneReturned) {
  MakeCheckpoint("step_1", "old");
  const std::string staging = MakeCheckpoint(".step_1.partial", "new");
  auto previous = PublishDirectory(staging, root_ + "/step_1");
  ASSERT_TRUE(previous.ok()) << previous.status().message();
  EXPECT_EQ(Read(root_ + "/step_1/data"), "new");
  ASSERT_FALSE(previous->empty());
  EXPECT_EQ(Read(*previous + "/data"), "old");
}

TEST_F(PublishTest, MissingStagingDirectoryIsAnErrorNamingIt) {
  auto previous = PublishDirectory(root_ + "/.nothing", root_ + "/step_1");
  ASSERT_FALSE(previous.ok());
  EXPECT_NE(previous.status().message().find(".nothing"), std::string::npos);
}

TEST_F(PublishTest, SyncDirectoryOfAFileFails) {
  std::ofstream(root_ + "/file") << "x";
  EXPECT_FALSE(SyncDirectory(root_ + "/file").ok());
  EXPECT_TRUE(SyncDirectory(root_).ok());
}

}  // namespace
}  // namespace fanrun
