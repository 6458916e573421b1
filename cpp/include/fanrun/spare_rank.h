// A rank started before its call. Its program (fanrun's worker, which imports what the ranks
// will need while it waits) runs under a keeper, with its output on /dev/null and its control
// channel a socket. A Supervisor hands it a call over that socket (Supervisor::Start's spares):
// the rank's stdout and stderr, directory, argv and environment. From then on it is supervised
// like any other rank: the same keeper, control channel, signals and exit. A rank whose call
// keeps it alive (kControlKept) becomes a spare again when its call is over.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>

#include "fanrun/fd.h"
#include "fanrun/kept_process.h"
#include "fanrun/process.h"
#include "fanrun/status.h"

namespace fanrun {

class SpareRank {
 public:
  // Starts `options` (its argv, environment and directory) under `keeper`; its descriptors are
  // set here.
  static Result<SpareRank> Start(const std::string& keeper, SpawnOptions options);
  // A rank that said kControlKept at the end of its call: it waits for another one on
  // `channel`, the supervisor's end of its control channel.
  static Result<SpareRank> Kept(KeptProcess process, FileDescriptor channel);
  // A spare forked from a zygote (spare_zygote.h), ready at once; `channel`: our end of its
  // control channel.
  static Result<SpareRank> Forked(KeptProcess process, FileDescriptor channel);
  SpareRank(SpareRank&& other) noexcept = default;
  SpareRank& operator=(SpareRank&&) = delete;

  pid_t pid() const { return process_.pid(); }
  // False once its program has ended: killed, or it failed before any call came.
  bool waiting() const;
  // Whether it has said that its imports are done (kSpareReady), waiting up to timeout_s for it.
  Result<bool> WaitReady(double timeout_s);

  // Sends it the call of one rank (run_contract.h, kSpareCall). On success the process and the
  // supervisor's end of its control channel are the caller's; the spare is spent either way.
  Result<std::pair<KeptProcess, FileDescriptor>> Become(const SpawnOptions& call, int stdout_fd, int stderr_fd) &&;

 private:
  SpareRank(KeptProcess process, FileDescriptor channel) : process_(std::move(process)), channel_(std::move(channel)) {}

  KeptProcess process_;
  FileDescriptor channel_;
  std::string said_;  // what it has written on its channel so far
  bool ready_ = false;
};

}  // namespace fanrun
