// Starting a spare rank, and handing it its call.
#include "fanrun/spare_rank.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "fanrun/run_contract.h"

namespace fanrun {
namespace {

// The call's body: its directory, the count of its argv, its argv, then its environment, each
// string ended by a NUL.
std::string CallBody(const SpawnOptions& call) {
  std::string body;
  auto add = [&body](const std::string& text) {
    body += text;
    body.push_back('\0');
  };
  add(call.cwd);
  add(std::to_string(call.argv.size()));
  for (const std::string& arg : call.argv) add(arg);
  for (const std::string& entry : call.env) add(entry);
  return body;
}

}  // namespace

Result<SpareRank> SpareRank::Start(const std::string& keeper, SpawnOptions options) {
  int sockets[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets) != 0) {
    return DescriptorError(errno, "Failed to create a spare rank's control channel");
  }
  FileDescriptor ours(sockets[0]), theirs(sockets[1]);
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor null, OpenFile("/dev/null", O_WRONLY));
  // What it prints while it imports is not any call's output.
  options.stdout_fd = null.fd();
  options.stderr_fd = null.fd();
  options.control_fd = theirs.fd();
  FANRUN_ASSIGN_OR_RETURN(KeptProcess process, KeptProcess::Start(keeper, options));
  return SpareRank(std::move(process), std::move(ours));
}

Result<SpareRank> SpareRank::Kept(KeptProcess process, FileDescriptor channel) {
  // The supervisor read it without blocking; a call is handed over with blocking sends.
  FANRUN_RETURN_NOT_OK(SetBlocking(channel.fd()));
  SpareRank spare(std::move(process), std::move(channel));
  spare.ready_ = true;
  return spare;
}

bool SpareRank::waiting() const {
  pollfd p{process_.pidfd(), POLLIN, 0};
  return !process_.reaped() && ::poll(&p, 1, 0) == 0;
}

Result<bool> SpareRank::WaitReady(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!ready_) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{channel_.fd(), POLLIN, 0};
    const int polled = ::poll(&p, 1, static_cast<int>(std::max<long long>(left, 0)));
    if (polled < 0 && errno == EINTR) continue;
    if (polled < 0) return Status::IOErrorFromErrno(errno, "Failed to wait for spare rank ", pid());
    if (polled == 0) return false;
    char buffer[64];
    const ssize_t n = ::recv(channel_.fd(), buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n <= 0) return false;  // it has ended, or nothing after all
    said_.append(buffer, static_cast<size_t>(n));
    ready_ = said_.find(std::string(kSpareReady) + "\n") != std::string::npos;
  }
  return true;
}

Result<std::pair<KeptProcess, FileDescriptor>> SpareRank::Become(const SpawnOptions& call, int stdout_fd,
                                                                  int stderr_fd) && {
  const std::string body = CallBody(call);
  const std::string message = std::string(kSpareCall) + std::to_string(body.size()) + "\n" + body;
  // The descriptors travel with the message's first bytes; the rest follows as a stream.
  iovec data{const_cast<char*>(message.data()), message.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  msghdr header{};
  header.msg_iov = &data;
  header.msg_iovlen = 1;
  header.msg_control = control;
  header.msg_controllen = sizeof(control);
  cmsghdr* rights = CMSG_FIRSTHDR(&header);
  rights->cmsg_level = SOL_SOCKET;
  rights->cmsg_type = SCM_RIGHTS;
  rights->cmsg_len = CMSG_LEN(2 * sizeof(int));
  const int fds[2] = {stdout_fd, stderr_fd};
  std::memcpy(CMSG_DATA(rights), fds, sizeof(fds));
  ssize_t sent;
  do {
    sent = ::sendmsg(channel_.fd(), &header, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) {
    return Status::IOErrorFromErrno(errno, "The spare rank (pid ", pid(), ") could not be handed its call; it has ended");
  }
  for (size_t done = static_cast<size_t>(sent); done < message.size(); done += static_cast<size_t>(sent)) {
    sent = ::send(channel_.fd(), message.data() + done, message.size() - done, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) sent = 0;
    if (sent < 0) return Status::IOErrorFromErrno(errno, "The spare rank (pid ", pid(), ") ended while taking its call");
  }
  return std::pair<KeptProcess, FileDescriptor>(std::move(process_), std::move(channel_));
}

}  // namespace fanrun
