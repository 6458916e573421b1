// Sending descriptors over a spare's or a zygote's control channel, and waiting for its lines.
#include "spare/channel_internal.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace fanrun::spare {

Result<QuietStart> PrepareQuietStart(SpawnOptions* options, const std::string& whose) {
  int sockets[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets) != 0) {
    return DescriptorError(errno, "Failed to create " + whose + " control channel");
  }
  QuietStart start{FileDescriptor(sockets[0]), FileDescriptor(sockets[1]), FileDescriptor()};
  FANRUN_ASSIGN_OR_RETURN(start.null, OpenFile("/dev/null", O_WRONLY));
  options->stdout_fd = start.null.fd();
  options->stderr_fd = start.null.fd();
  options->control_fd = start.theirs.fd();
  return start;
}

Status SendWithDescriptors(int channel, std::string_view message, std::initializer_list<int> fds,
                           const std::string& who) {
  iovec data{const_cast<char*>(message.data()), message.size()};
  std::vector<char> control(CMSG_SPACE(fds.size() * sizeof(int)));
  msghdr header{};
  header.msg_iov = &data;
  header.msg_iovlen = 1;
  header.msg_control = control.data();
  header.msg_controllen = control.size();
  cmsghdr* rights = CMSG_FIRSTHDR(&header);
  rights->cmsg_level = SOL_SOCKET;
  rights->cmsg_type = SCM_RIGHTS;
  rights->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
  std::memcpy(CMSG_DATA(rights), fds.begin(), fds.size() * sizeof(int));
  ssize_t sent;
  do {
    sent = ::sendmsg(channel, &header, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) return Status::IOErrorFromErrno(errno, who, " could not be sent its message; it has ended");
  for (size_t done = static_cast<size_t>(sent); done < message.size(); done += static_cast<size_t>(sent)) {
    sent = ::send(channel, message.data() + done, message.size() - done, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) sent = 0;
    if (sent < 0) return Status::IOErrorFromErrno(errno, who, " ended while taking its message");
  }
  return Status::OK();
}

Result<bool> WaitForLine(int channel, std::string_view line, double timeout_s, std::string* said) {
  const std::string wanted = std::string(line) + "\n";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (said->find(wanted) == std::string::npos) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{channel, POLLIN, 0};
    const int polled = ::poll(&p, 1, static_cast<int>(std::max<long long>(left, 0)));
    if (polled < 0 && errno == EINTR) continue;
    if (polled < 0) return Status::IOErrorFromErrno(errno, "Failed to wait on a spare's channel");
    if (polled == 0) return false;
    char buffer[64];
    const ssize_t n = ::recv(channel, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n <= 0) return false;  // it has ended, or nothing after all
    said->append(buffer, static_cast<size_t>(n));
  }
  return true;
}

}  // namespace fanrun::spare
