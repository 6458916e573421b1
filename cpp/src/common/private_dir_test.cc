// Tests of private directories: made 0700, refused when another user owns or can write them.
#include "fanrun/private_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

constexpr uid_t kNobody = 65534;

class PrivateDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::MakeTempDir("fanrun-private-dir-test");
    ASSERT_FALSE(root_.empty());
  }
  void TearDown() override { ASSERT_TRUE(testing::RemoveTree(root_)); }

  static mode_t ModeOf(const std::string& path) {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0 ? st.st_mode & 07777 : 0;
  }

  std::string root_;
};

TEST_F(PrivateDirTest, MakesMissingDirectories0700WhateverTheUmask) {
  for (mode_t mask : {mode_t{0}, mode_t{022}}) {
    const mode_t previous = ::umask(mask);
    const std::string top = root_ + "/u" + std::to_string(mask);
    auto dir = OpenPrivateDirectory(top + "/a/b");
    ::umask(previous);
    ASSERT_TRUE(dir.ok()) << dir.status().message();
    EXPECT_EQ(dir->path, top + "/a/b");
    for (const std::string& made : {top, top + "/a", top + "/a/b"}) EXPECT_EQ(ModeOf(made), 0700u) << made;
    auto sub = OpenPrivateSubdirectory(*dir, "files");
    ASSERT_TRUE(sub.ok()) << sub.status().message();
    EXPECT_EQ(ModeOf(top + "/a/b/files"), 0700u);
  }
}

TEST_F(PrivateDirTest, ADirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory away";
  const std::string theirs = root_ + "/theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  auto dir = OpenPrivateDirectory(theirs);
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("'" + theirs + "' belongs to uid 65534, not to uid 0"), std::string::npos)
      << dir.status().message();

  auto mine = OpenPrivateDirectory(root_);
  ASSERT_TRUE(mine.ok()) << mine.status().message();
  auto sub = OpenPrivateSubdirectory(*mine, "theirs");
  ASSERT_FALSE(sub.ok());
  EXPECT_NE(sub.status().message().find("belongs to uid 65534"), std::string::npos) << sub.status().message();
}

TEST_F(PrivateDirTest, ADirectoryOthersCanWriteIsRefusedEvenWhenSticky) {
  for (mode_t mode : {mode_t{0777}, mode_t{01777}, mode_t{0770}}) {
    const std::string shared = root_ + "/shared" + std::to_string(mode);
    ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
    ASSERT_EQ(::chmod(shared.c_str(), mode), 0);
    auto dir = OpenPrivateDirectory(shared);
    ASSERT_FALSE(dir.ok()) << shared;
    EXPECT_NE(dir.status().message().find("can be written by other users"), std::string::npos) << dir.status().message();
  }
}

TEST_F(PrivateDirTest, ADirectoryAboveOthersCanWriteIsRefusedUnlessSticky) {
  const std::string open = root_ + "/open";
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  auto dir = OpenPrivateDirectory(open + "/mine");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("on the way to the directory, can be written by other users"), std::string::npos)
      << dir.status().message();
  ASSERT_EQ(::chmod(open.c_str(), 01777), 0);  // as /tmp: no one else may move what is in it
  auto sticky = OpenPrivateDirectory(open + "/mine");
  EXPECT_TRUE(sticky.ok()) << sticky.status().message();
}

TEST_F(PrivateDirTest, ADirectoryAboveOwnedByAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory away";
  const std::string theirs = root_ + "/theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((theirs + "/mine").c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  auto dir = OpenPrivateDirectory(theirs + "/mine");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("belongs to uid 65534, who could move another directory"), std::string::npos)
      << dir.status().message();
}

TEST_F(PrivateDirTest, ALinkToTheDirectoryIsResolvedButASubdirectoryLinkIsRefused) {
  const std::string real = root_ + "/real";
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), (root_ + "/link").c_str()), 0);
  auto dir = OpenPrivateDirectory(root_ + "/link");
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  EXPECT_EQ(dir->path, real);

  ASSERT_EQ(::mkdir((root_ + "/elsewhere").c_str(), 0700), 0);
  ASSERT_EQ(::symlink((root_ + "/elsewhere").c_str(), (real + "/files").c_str()), 0);
  auto sub = OpenPrivateSubdirectory(*dir, "files");
  ASSERT_FALSE(sub.ok());
  EXPECT_NE(sub.status().message().find("symbolic link"), std::string::npos) << sub.status().message();
}

TEST_F(PrivateDirTest, AnOwnSubdirectoryWithAWiderModeIsNarrowed) {
  auto dir = OpenPrivateDirectory(root_);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  ASSERT_EQ(::mkdir((root_ + "/files").c_str(), 0700), 0);
  ASSERT_EQ(::chmod((root_ + "/files").c_str(), 0755), 0);
  ASSERT_TRUE(OpenPrivateSubdirectory(*dir, "files").ok());
  EXPECT_EQ(ModeOf(root_ + "/files"), 0700u);
}

}  // namespace
}  // namespace fanrun
