// Tests of what spares and zygotes share on their channels: descriptors sent with a message
// longer than a socket holds, and lines waited for.
#include "spare/channel_internal.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "fanrun/fd.h"

namespace fanrun::spare {
namespace {

TEST(SpareChannelTest, SendsDescriptorsWithAMessageLongerThanTheSocketHolds) {
  int sockets[2], pipe_fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets), 0);
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  FileDescriptor sender(sockets[0]), receiver(sockets[1]), read_end(pipe_fds[0]), write_end(pipe_fds[1]);
  const std::string message(4 << 20, 'x');
  std::string received;
  int got_fd = -1;
  std::thread reader([&] {
    char buffer[65536];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    iovec data{buffer, sizeof(buffer)};
    msghdr header{};
    header.msg_iov = &data;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(receiver.fd(), &header, MSG_CMSG_CLOEXEC);
    if (n > 0 && CMSG_FIRSTHDR(&header) != nullptr) std::memcpy(&got_fd, CMSG_DATA(CMSG_FIRSTHDR(&header)), sizeof(int));
    while (n > 0) {
      received.append(buffer, static_cast<size_t>(n));
      if (received.size() == message.size()) break;
      n = ::recv(receiver.fd(), buffer, sizeof(buffer), 0);
    }
  });
  EXPECT_TRUE(SendWithDescriptors(sender.fd(), message, {write_end.fd()}, "the test's reader").ok());
  reader.join();
  EXPECT_EQ(received, message);
  ASSERT_GE(got_fd, 0);
  FileDescriptor passed(got_fd);
  ASSERT_EQ(::write(passed.fd(), "!", 1), 1);  // the same pipe, reached through the passed descriptor
  char c = 0;
  ASSERT_EQ(::read(read_end.fd(), &c, 1), 1);
  EXPECT_EQ(c, '!');
}

TEST(SpareChannelTest, ASendToAnEndedReaderIsAnError) {
  int sockets[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets), 0);
  FileDescriptor sender(sockets[0]), receiver(sockets[1]);
  ASSERT_TRUE(receiver.Close().ok());
  const Status sent = SendWithDescriptors(sender.fd(), "call", {sender.fd()}, "The spare rank (pid 1)");
  ASSERT_FALSE(sent.ok());
  EXPECT_NE(sent.message().find("The spare rank (pid 1) could not be sent its message"), std::string::npos);
}

TEST(SpareChannelTest, WaitsForALineUntilItComesTheTimeoutOrTheEnd) {
  int sockets[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets), 0);
  FileDescriptor ours(sockets[0]), theirs(sockets[1]);
  std::string said;
  auto early = WaitForLine(ours.fd(), "ready", 0.05, &said);
  ASSERT_TRUE(early.ok());
  EXPECT_FALSE(*early);
  ASSERT_EQ(::write(theirs.fd(), "rea", 3), 3);
  auto partial = WaitForLine(ours.fd(), "ready", 0.05, &said);
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(*partial);
  ASSERT_EQ(::write(theirs.fd(), "dy\n", 3), 3);
  auto ready = WaitForLine(ours.fd(), "ready", 5, &said);
  ASSERT_TRUE(ready.ok());
  EXPECT_TRUE(*ready);
  EXPECT_EQ(said, "ready\n");
  std::string other;
  ASSERT_TRUE(theirs.Close().ok());
  auto ended = WaitForLine(ours.fd(), "ready", 5, &other);
  ASSERT_TRUE(ended.ok());
  EXPECT_FALSE(*ended);
}

}  // namespace
}  // namespace fanrun::spare
