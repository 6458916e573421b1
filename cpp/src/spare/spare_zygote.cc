// Starting a spare zygote, and forking spares from it.
#include "fanrun/spare_zygote.h"

#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>

#include "fanrun/kept_process.h"
#include "fanrun/run_contract.h"
#include "spare/channel_internal.h"

namespace fanrun {

Result<SpareZygote> SpareZygote::Start(SpawnOptions options) {
  FANRUN_ASSIGN_OR_RETURN(spare::QuietStart start, spare::PrepareQuietStart(&options, "a spare zygote's"));
  // Not the death of the thread that starts it (a pool's filling thread ends at once): the end
  // of its channel, which comes with the caller's, ends it (_rank/zygote.py).
  options.parent_death_signal = 0;
  FANRUN_ASSIGN_OR_RETURN(ChildProcess process, Spawn(options));
  return SpareZygote(std::move(process), std::move(start.ours));
}

bool SpareZygote::alive() const {
  pollfd p{process_.pidfd(), POLLIN, 0};
  return !process_.reaped() && ::poll(&p, 1, 0) == 0;
}

Result<bool> SpareZygote::WaitReady(double timeout_s) {
  if (!ready_) {
    FANRUN_ASSIGN_OR_RETURN(ready_, spare::WaitForLine(channel_.fd(), kSpareReady, timeout_s, &said_));
  }
  return ready_;
}

Result<SpareRank> SpareZygote::Fork(const std::string& keeper) {
  if (!ready_) return Status::Invalid("The spare zygote (pid ", pid(), ") has not finished its imports");
  int keeper_sockets[2], spare_sockets[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, keeper_sockets) != 0) {
    return DescriptorError(errno, "Failed to create a forked spare's keeper socket");
  }
  FileDescriptor keeper_ours(keeper_sockets[0]), keeper_theirs(keeper_sockets[1]);
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, spare_sockets) != 0) {
    return DescriptorError(errno, "Failed to create a forked spare's control channel");
  }
  FileDescriptor spare_ours(spare_sockets[0]), spare_theirs(spare_sockets[1]);
  const std::string who = "The spare zygote (pid " + std::to_string(pid()) + ")";
  FANRUN_RETURN_NOT_OK(spare::SendWithDescriptors(channel_.fd(), std::string(kZygoteFork) + keeper + "\n",
                                                  {keeper_theirs.fd(), spare_theirs.fd()}, who));
  // Ours no longer: the zygote's forks hold them, so that their ends show when those end.
  FANRUN_RETURN_NOT_OK(keeper_theirs.Close());
  FANRUN_RETURN_NOT_OK(spare_theirs.Close());
  // Its answer: the forked keeper's pid and a newline (the zygote forks one at a time).
  std::string answer;
  char c;
  while (answer.size() < 16) {
    const ssize_t n = ::recv(channel_.fd(), &c, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IOError(who, " ended before it forked a spare");
    if (c == '\n') break;
    answer.push_back(c);
  }
  char* end = nullptr;
  const long keeper_pid = std::strtol(answer.c_str(), &end, 10);
  if (answer.empty() || *end != '\0' || keeper_pid <= 0) {
    return Status::IOError(who, " answered '", answer, "' instead of a forked keeper's pid");
  }
  FANRUN_ASSIGN_OR_RETURN(KeptProcess process, KeptProcess::Adopt(static_cast<pid_t>(keeper_pid), std::move(keeper_ours)));
  return SpareRank::Forked(std::move(process), std::move(spare_ours));
}

}  // namespace fanrun
