// One program run under a rank keeper (fanrun-keeper): a small process between the owner and
// the program that is a child subreaper, so that everything the program starts, in any process
// group or session, double-forked or not, stays below it. When the program ends, or the owner
// closes the keeper's channel or dies (even by SIGKILL), the keeper kills and reaps every one
// of those processes, then exits: the keeper's exit means that nothing of the program is left.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "fanrun/fd.h"
#include "fanrun/process.h"
#include "fanrun/status.h"

namespace fanrun {

class KeptProcess {
 public:
  // Starts `keeper` (the fanrun-keeper executable), which starts the program of `options`
  // with its descriptors, environment and directory; returns once the program runs.
  static Result<KeptProcess> Start(const std::string& keeper, const SpawnOptions& options);
  KeptProcess(KeptProcess&& other) noexcept = default;
  KeptProcess& operator=(KeptProcess&&) = delete;
  // A keeper still running is told to kill everything, and reaped.
  ~KeptProcess();

  // The program's pid (not the keeper's).
  pid_t pid() const { return pid_; }
  // Readable once the program and every process it started are gone.
  int pidfd() const { return keeper_.pidfd(); }
  bool reaped() const { return keeper_.reaped(); }

  // To the program alone.
  Status Signal(int signo) const;
  // To the program and every process it started.
  Status SignalAll(int signo) const;
  // SIGKILL to the program and every process it started, at once; Wait or TryReap to collect.
  void KillAll();
  // How the program ended, once its keeper has cleaned up and exited; nullopt before.
  Result<std::optional<ExitStatus>> TryReap();
  Result<ExitStatus> Wait();

 private:
  KeptProcess(ChildProcess keeper, FileDescriptor channel, pid_t pid)
      : keeper_(std::move(keeper)), channel_(std::move(channel)), pid_(pid) {}
  Status Send(int signo, bool all) const;
  ExitStatus ProgramExit(const ExitStatus& keeper_exit) const;

  ChildProcess keeper_;
  FileDescriptor channel_;
  pid_t pid_;
};

}  // namespace fanrun
