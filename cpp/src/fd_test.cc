// Tests of owned descriptors and pipes.
#include "fanrun/fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

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

}  // namespace
}  // namespace fanrun
