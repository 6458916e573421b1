// Starting a spare rank, and handing it its call.
#include "fanrun/spare_rank.h"

#include <poll.h>

#include "fanrun/run_contract.h"
#include "spare/channel_internal.h"

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
  FANRUN_ASSIGN_OR_RETURN(spare::QuietStart start, spare::PrepareQuietStart(&options, "a spare rank's"));
  FANRUN_ASSIGN_OR_RETURN(KeptProcess process, KeptProcess::Start(keeper, options));
  return SpareRank(std::move(process), std::move(start.ours));
}

Result<SpareRank> SpareRank::Forked(KeptProcess process, FileDescriptor channel) {
  // Its imports were the zygote's, done before it forked: it says nothing before its call.
  SpareRank spare(std::move(process), std::move(channel));
  spare.ready_ = true;
  return spare;
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
  if (!ready_) {
    FANRUN_ASSIGN_OR_RETURN(ready_, spare::WaitForLine(channel_.fd(), kSpareReady, timeout_s, &said_));
  }
  return ready_;
}

Result<std::pair<KeptProcess, FileDescriptor>> SpareRank::Become(const SpawnOptions& call, int stdout_fd,
                                                                  int stderr_fd) && {
  const std::string body = CallBody(call);
  const std::string message = std::string(kSpareCall) + std::to_string(body.size()) + "\n" + body;
  FANRUN_RETURN_NOT_OK(spare::SendWithDescriptors(channel_.fd(), message, {stdout_fd, stderr_fd},
                                                  "The spare rank (pid " + std::to_string(pid()) + ")"));
  return std::pair<KeptProcess, FileDescriptor>(std::move(process_), std::move(channel_));
}

}  // namespace fanrun
