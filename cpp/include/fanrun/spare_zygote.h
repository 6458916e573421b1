// A spare zygote: an interpreter that has done the imports of spare ranks (spare_rank.h) once,
// and forks spares from itself on demand, each ready at once, under a keeper of its own
// (`fanrun-keeper --adopt`). Warm calls in a loop take spares faster than fresh interpreters
// can import torch; a fork takes milliseconds.
//
// The zygote is our child, without a keeper: its forks leave its process group, so that it can
// be dropped (its imports stale) while spares forked from it are a call's ranks. It ends when
// its channel does, as the caller does; each forked keeper ends with its own channel's other
// end, held here. So nothing outlives the caller.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <string>

#include "fanrun/fd.h"
#include "fanrun/process.h"
#include "fanrun/spare_rank.h"
#include "fanrun/status.h"

namespace fanrun {

class SpareZygote {
 public:
  // Starts `options` (its argv, environment and directory); its descriptors are set here.
  static Result<SpareZygote> Start(SpawnOptions options);
  SpareZygote(SpareZygote&& other) noexcept = default;
  SpareZygote& operator=(SpareZygote&&) = delete;

  pid_t pid() const { return process_.pid(); }
  // False once it has ended.
  bool alive() const;
  // SIGKILL, from any thread: a WaitReady in another one returns false.
  Status Kill() const { return process_.Signal(SIGKILL); }
  // Whether it has said that its imports are done, waiting up to timeout_s for it.
  Result<bool> WaitReady(double timeout_s);

  // A spare forked from it, whose keeper is `keeper` (the fanrun-keeper executable). Only once
  // WaitReady has said true.
  Result<SpareRank> Fork(const std::string& keeper);

 private:
  SpareZygote(ChildProcess process, FileDescriptor channel) : process_(std::move(process)), channel_(std::move(channel)) {}

  ChildProcess process_;
  FileDescriptor channel_;
  std::string said_;
  bool ready_ = false;
};

}  // namespace fanrun
