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
  // A keeper that another process started for us (`fanrun-keeper --adopt`, run by a spare
  // zygote for each spare it forks): not our child, so its end is watched through a pidfd and
  // how the program ended comes from the keeper's report alone. `channel`: our end of its
  // socket; returns once the keeper has said that it keeps its program.
  static Result<KeptProcess> Adopt(pid_t keeper_pid, FileDescriptor channel);
  KeptProcess(KeptProcess&& other) noexcept = default;
  KeptProcess& operator=(KeptProcess&&) = delete;
  // A keeper still running is told to kill everything, and reaped.
  ~KeptProcess();

  // The program's pid (not the keeper's).
  pid_t pid() const { return pid_; }
  // Readable once the program and every process it started are gone.
  int pidfd() const { return keeper_ ? keeper_->pidfd() : adopted_pidfd_.fd(); }
  bool reaped() const { return keeper_ ? keeper_->reaped() : adopted_ended_ || !adopted_pidfd_.valid(); }

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
  KeptProcess(FileDescriptor adopted_pidfd, FileDescriptor channel, pid_t pid)
      : adopted_pidfd_(std::move(adopted_pidfd)), channel_(std::move(channel)), pid_(pid) {}
  Status Send(int signo, bool all) const;
  ExitStatus ProgramExit(const ExitStatus& keeper_exit) const;
  // An adopted keeper's end, seen through its pidfd; nullopt while it runs (with timeout_ms 0).
  Result<std::optional<ExitStatus>> AdoptedEnd(int timeout_ms);

  std::optional<ChildProcess> keeper_;  // a keeper started here: our child, reaped here
  FileDescriptor adopted_pidfd_;        // or an adopted one, reaped by its own parent
  bool adopted_ended_ = false;
  FileDescriptor channel_;
  pid_t pid_;
};

}  // namespace fanrun
