// Tests of the private-directory rule: directories made 0700 and files 0600; refused, naming the
// path, why and what to do, when another user owns them or can write them or a directory above
// them, or when a link stands where fanrun follows none.
#include "fanrun/private_dir.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <utility>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

constexpr uid_t kNobody = 65534;
const DirectoryDescription kTestDir{"The test directory", "Use another one."};

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

  // The refusal of `path`, which must be an unsafe path's, ending with the remedy.
  static std::string Refusal(const std::string& path) {
    auto dir = OpenPrivateDirectory(path, kTestDir);
    EXPECT_FALSE(dir.ok()) << path;
    if (dir.ok()) return "";
    EXPECT_EQ(dir.status().code(), StatusCode::kUnsafePath) << dir.status().message();
    const std::string message = dir.status().message();
    EXPECT_EQ(message.substr(message.size() - kTestDir.remedy.size()), kTestDir.remedy) << message;
    return message;
  }

  std::string root_;
};

TEST_F(PrivateDirTest, MakesMissingDirectories0700WhateverTheUmask) {
  for (mode_t mask : {mode_t{0}, mode_t{022}}) {
    const mode_t previous = ::umask(mask);
    const std::string top = root_ + "/u" + std::to_string(mask);
    auto dir = OpenPrivateDirectory(top + "/a/./b", kTestDir);
    ::umask(previous);
    ASSERT_TRUE(dir.ok()) << dir.status().message();
    EXPECT_EQ(dir->path, top + "/a/b");
    for (const std::string& made : {top, top + "/a", top + "/a/b"}) EXPECT_EQ(ModeOf(made), 0700u) << made;
    auto sub = OpenPrivateSubdirectory(*dir, "files", kTestDir);
    ASSERT_TRUE(sub.ok()) << sub.status().message();
    EXPECT_EQ(ModeOf(top + "/a/b/files"), 0700u);
  }
}

TEST_F(PrivateDirTest, ARelativePathIsTheWorkingDirectorysAndDotDotIsTakenAsWritten) {
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  ASSERT_EQ(::chdir(root_.c_str()), 0);
  auto dir = OpenPrivateDirectory("x/../y", kTestDir);
  ASSERT_EQ(::chdir(cwd), 0);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  EXPECT_EQ(dir->path, root_ + "/y");
  EXPECT_EQ(ModeOf(root_ + "/x"), 0u);  // never made: ".." takes it out before anything is opened
}

TEST_F(PrivateDirTest, TheRootIsRefused) {
  EXPECT_EQ(Refusal("/"), "The test directory cannot be '/'. Use another one.");
}

TEST_F(PrivateDirTest, ADirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory away";
  const std::string theirs = root_ + "/theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  EXPECT_NE(Refusal(theirs).find("The test directory '" + theirs + "' belongs to uid 65534, not to you (uid 0): its owner "
                                 "could plant files"),
            std::string::npos);

  auto mine = OpenPrivateDirectory(root_, kTestDir);
  ASSERT_TRUE(mine.ok()) << mine.status().message();
  auto sub = OpenPrivateSubdirectory(*mine, "theirs", kTestDir);
  ASSERT_FALSE(sub.ok());
  EXPECT_EQ(sub.status().code(), StatusCode::kUnsafePath);
  EXPECT_NE(sub.status().message().find("belongs to uid 65534"), std::string::npos) << sub.status().message();
}

TEST_F(PrivateDirTest, ADirectoryOthersCanWriteIsRefusedEvenWhenSticky) {
  for (mode_t mode : {mode_t{0777}, mode_t{01777}, mode_t{0770}}) {
    const std::string shared = root_ + "/shared" + std::to_string(mode);
    ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
    ASSERT_EQ(::chmod(shared.c_str(), mode), 0);
    char expected[16];
    std::snprintf(expected, sizeof(expected), "(mode %04o)", static_cast<unsigned>(mode));
    const std::string refusal = Refusal(shared);
    EXPECT_NE(refusal.find("'" + shared + "' can be written by other users " + expected), std::string::npos) << refusal;
    EXPECT_NE(refusal.find("chmod go-w '" + shared + "'"), std::string::npos) << refusal;
  }
}

TEST_F(PrivateDirTest, ADirectoryAboveOthersCanWriteIsRefusedUnlessSticky) {
  const std::string open = root_ + "/open";
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  EXPECT_NE(Refusal(open + "/mine").find("lies under '" + open + "', which other users can write (mode 0777) and is not "
                                         "sticky"),
            std::string::npos);
  EXPECT_EQ(ModeOf(open + "/mine"), 0u);  // refused before anything is made below it
  ASSERT_EQ(::chmod(open.c_str(), 01777), 0);  // as /tmp: no one else may move what is in it
  auto sticky = OpenPrivateDirectory(open + "/mine", kTestDir);
  EXPECT_TRUE(sticky.ok()) << sticky.status().message();
}

TEST_F(PrivateDirTest, ADirectoryAboveOwnedByAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory away";
  const std::string theirs = root_ + "/theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((theirs + "/mine").c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  EXPECT_NE(Refusal(theirs + "/mine").find("lies under '" + theirs + "', which belongs to uid 65534: that user could move"),
            std::string::npos);
}

TEST_F(PrivateDirTest, ALinkAboveIsFollowedWhereItsUserMadeItButNeverAsTheDirectoryItself) {
  const std::string real = root_ + "/real";
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), (root_ + "/link").c_str()), 0);
  auto below = OpenPrivateDirectory(root_ + "/link/mine", kTestDir);
  ASSERT_TRUE(below.ok()) << below.status().message();
  EXPECT_EQ(below->path, root_ + "/link/mine");  // named as given: the link is followed, not resolved
  EXPECT_EQ(ModeOf(real + "/mine"), 0700u);

  EXPECT_NE(Refusal(root_ + "/link").find("The test directory: '" + root_ + "/link' is a symbolic link, and fanrun "
                                          "follows no link to the directory it keeps files in"),
            std::string::npos);

  ASSERT_EQ(::mkdir((root_ + "/elsewhere").c_str(), 0700), 0);
  ASSERT_EQ(::symlink((root_ + "/elsewhere").c_str(), (real + "/files").c_str()), 0);
  auto dir = OpenPrivateDirectory(real, kTestDir);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  auto sub = OpenPrivateSubdirectory(*dir, "files", kTestDir);
  ASSERT_FALSE(sub.ok());
  EXPECT_EQ(sub.status().code(), StatusCode::kUnsafePath);
  EXPECT_NE(sub.status().message().find("is a symbolic link"), std::string::npos) << sub.status().message();
}

TEST_F(PrivateDirTest, ALinkAboveThatAnotherUserMadeIsNotFollowed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a link away";
  ASSERT_EQ(::mkdir((root_ + "/real").c_str(), 0700), 0);
  const std::string link = root_ + "/link";
  ASSERT_EQ(::symlink((root_ + "/real").c_str(), link.c_str()), 0);
  ASSERT_EQ(::lchown(link.c_str(), kNobody, kNobody), 0);
  EXPECT_NE(Refusal(link + "/mine").find("'" + link + "' is a symbolic link made by uid 65534, and fanrun follows no link "
                                         "that another user made"),
            std::string::npos);
}

TEST_F(PrivateDirTest, AnOwnSubdirectoryWithAWiderModeIsNarrowed) {
  auto dir = OpenPrivateDirectory(root_, kTestDir);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  ASSERT_EQ(::mkdir((root_ + "/files").c_str(), 0700), 0);
  ASSERT_EQ(::chmod((root_ + "/files").c_str(), 0755), 0);
  ASSERT_TRUE(OpenPrivateSubdirectory(*dir, "files", kTestDir).ok());
  EXPECT_EQ(ModeOf(root_ + "/files"), 0700u);
}

TEST_F(PrivateDirTest, APathOrANameThatIsNotOneIsRefusedBeforeAnythingIsOpened) {
  auto dir = OpenPrivateDirectory(root_, kTestDir);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  auto nul = OpenPrivateDirectory(root_ + std::string("/a\0b", 4), kTestDir);
  ASSERT_FALSE(nul.ok());
  EXPECT_EQ(nul.status().code(), StatusCode::kInvalid);
  EXPECT_NE(nul.status().message().find("/a\\x00b' holds a NUL byte"), std::string::npos) << nul.status().message();
  for (const std::string& name : {std::string("../escaped"), std::string("a/b"), std::string(".."), std::string()}) {
    auto sub = OpenPrivateSubdirectory(*dir, name, kTestDir);
    ASSERT_FALSE(sub.ok()) << name;
    EXPECT_EQ(sub.status().code(), StatusCode::kInvalid) << name;
    auto file = OpenPrivateFile(dir->fd.fd(), name, O_RDWR | O_CREAT);
    ASSERT_FALSE(file.ok()) << name;
    EXPECT_NE(file.status().message().find("is not the name of an entry in its directory"), std::string::npos)
        << file.status().message();
  }
  EXPECT_EQ(ModeOf(root_ + "/../escaped"), 0u);
}

TEST_F(PrivateDirTest, FilesAreMade0600AndOpenedOnlyWhenTheyAreTheUsersAlone) {
  auto dir = OpenPrivateDirectory(root_, kTestDir);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  const mode_t previous = ::umask(0);
  auto made = OpenPrivateFile(dir->fd.fd(), "made", O_WRONLY | O_CREAT | O_EXCL);
  ::umask(previous);
  ASSERT_TRUE(made.ok()) << made.status().message();
  EXPECT_EQ(ModeOf(root_ + "/made"), 0600u);
  EXPECT_TRUE(OpenPrivateFile(dir->fd.fd(), "made", O_RDONLY).ok());

  auto missing = OpenPrivateFile(dir->fd.fd(), "missing", O_RDONLY);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
  EXPECT_EQ(missing.status().errnum(), ENOENT);  // Python raises it as a FileNotFoundError

  ASSERT_EQ(::symlink((root_ + "/made").c_str(), (root_ + "/link").c_str()), 0);
  ASSERT_EQ(::mkdir((root_ + "/directory").c_str(), 0700), 0);
  ASSERT_EQ(::chmod((root_ + "/made").c_str(), 0640), 0);
  const std::pair<const char*, const char*> refusals[] = {
      {"link", "link is a symbolic link, and fanrun follows none in its own directories"},
      {"directory", "directory is not a regular file"},
      {"made", "others can read or write made (mode 0640)"},
  };
  for (const auto& [name, message] : refusals) {
    auto file = OpenPrivateFile(dir->fd.fd(), name, O_RDONLY);
    ASSERT_FALSE(file.ok()) << name;
    EXPECT_EQ(file.status().code(), StatusCode::kUnsafePath) << name;
    EXPECT_EQ(file.status().message(), message);
  }
  if (::geteuid() == 0) {
    ASSERT_EQ(::chmod((root_ + "/made").c_str(), 0600), 0);
    ASSERT_EQ(::chown((root_ + "/made").c_str(), kNobody, kNobody), 0);
    auto theirs = OpenPrivateFile(dir->fd.fd(), "made", O_RDONLY);
    ASSERT_FALSE(theirs.ok());
    EXPECT_EQ(theirs.status().message(), "made belongs to uid 65534, not to you (uid 0)");
  }
}

}  // namespace
}  // namespace fanrun
