// Tests of owned descriptors and pipes.
#include "fanrun/fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

namespace fanrun {
namespace {

TEST(FileDescriptorTest, PipeIsCloseOnExecAndCarriesBytes) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok()) << pipe.status().message();
  EXPECT_TRUE(::fcntl(pipe->read.fd(), F_GETFD) & FD_CLOEXEC);
  EXPECT_TRUE(::fcntl(pipe->write.fd(), F_GETFD) & FD_CLOEXEC);
  ASSERT_TRUE(WriteAll(pipe->write.fd(), "abc", 3).ok());
  char buffer[4] = {0};
  ASSERT_EQ(::read(pipe->read.fd(), buffer, 3), 3);
  EXPECT_STREQ(buffer, "abc");
}

TEST(FileDescriptorTest, CloseIsIdempotentAndMoveTransfersOwnership) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  const int raw = pipe->read.fd();
  FileDescriptor moved(std::move(pipe->read));
  EXPECT_FALSE(pipe->read.valid());
  EXPECT_EQ(moved.fd(), raw);
  EXPECT_TRUE(moved.Close().ok());
  EXPECT_TRUE(moved.Close().ok());
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);
}

TEST(FileDescriptorTest, OpenMissingFileIsNotFoundAndNamesThePath) {
  auto fd = OpenFile("/nonexistent/fanrun", O_RDONLY);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kNotFound);
  EXPECT_NE(fd.status().message().find("/nonexistent/fanrun"), std::string::npos);
}

TEST(FileDescriptorTest, DuplicateAboveGivesAHighCloseOnExecCopy) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  auto dup = DuplicateAbove(pipe->read.fd(), 100);
  ASSERT_TRUE(dup.ok());
  EXPECT_GE(dup->fd(), 100);
  EXPECT_TRUE(::fcntl(dup->fd(), F_GETFD) & FD_CLOEXEC);
}

TEST(FileDescriptorTest, OutOfDescriptorsNamesTheLimitAndTheWayOut) {
  // In a child process, which may run out of descriptors without harming the test runner.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = 64;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(2);
    while (::open("/dev/null", O_RDONLY) >= 0) {
    }
    auto pipe = MakePipe();
    const std::string message = pipe.ok() ? "" : pipe.status().message();
    std::fprintf(stderr, "%s\n", message.c_str());
    const bool named = message.find("Failed to create a pipe: out of file descriptors") == 0 &&
                       message.find("at most 64 open (RLIMIT_NOFILE") != std::string::npos &&
                       message.find("ulimit -n") != std::string::npos;
    ::_exit(named ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the error did not name the descriptor limit";
}

// The names a listing gives, sorted.
std::vector<std::string> Names(DirectoryListing& listing) {
  std::vector<std::string> names;
  while (const char* name = listing.Next()) names.emplace_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

int OpenDescriptors() {
  Result<DirectoryListing> fds = DirectoryListing::Open("/proc/self/fd");
  return fds.ok() ? static_cast<int>(Names(*fds).size()) : -1;
}

TEST(DirectoryListingTest, ListsEveryEntryAndClosesItsDescriptor) {
  char dir[] = "/tmp/fanrun-listing-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = dir;
  ASSERT_TRUE(OpenFile(path + "/a", O_WRONLY | O_CREAT).ok());
  ASSERT_TRUE(OpenFile(path + "/b", O_WRONLY | O_CREAT).ok());
  const int before = OpenDescriptors();
  {
    Result<DirectoryListing> listing = DirectoryListing::Open(path);
    ASSERT_TRUE(listing.ok()) << listing.status().message();
    DirectoryListing moved(std::move(listing).ValueOrDie());
    EXPECT_EQ(Names(moved), (std::vector<std::string>{".", "..", "a", "b"}));
    EXPECT_EQ(moved.Next(), nullptr);
  }
  EXPECT_EQ(OpenDescriptors(), before);
  ::unlink((path + "/a").c_str());
  ::unlink((path + "/b").c_str());
  ::rmdir(dir);
}

TEST(DirectoryListingTest, OpenAtLeavesTheDirectoryDescriptorAsItWas) {
  char dir[] = "/tmp/fanrun-listing-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = dir;
  ASSERT_TRUE(OpenFile(path + "/only", O_WRONLY | O_CREAT).ok());
  auto opened = OpenFile(path, O_RDONLY | O_DIRECTORY);
  ASSERT_TRUE(opened.ok());
  for (int round = 0; round < 2; ++round) {  // each listing starts at the first entry
    Result<DirectoryListing> listing = DirectoryListing::OpenAt(opened->fd(), path);
    ASSERT_TRUE(listing.ok()) << listing.status().message();
    EXPECT_EQ(Names(*listing), (std::vector<std::string>{".", "..", "only"}));
  }
  EXPECT_EQ(::lseek(opened->fd(), 0, SEEK_CUR), 0);
  EXPECT_GE(::fcntl(opened->fd(), F_GETFD), 0);
  ::unlink((path + "/only").c_str());
  ::rmdir(dir);
}

TEST(DirectoryListingTest, AMissingDirectoryNamesItsPath) {
  Result<DirectoryListing> listing = DirectoryListing::Open("/nonexistent/fanrun");
  ASSERT_FALSE(listing.ok());
  EXPECT_NE(listing.status().message().find("Failed to list '/nonexistent/fanrun'"), std::string::npos)
      << listing.status().message();
  Result<DirectoryListing> file = DirectoryListing::Open("/proc/self/status");
  EXPECT_FALSE(file.ok());
}

}  // namespace
}  // namespace fanrun
