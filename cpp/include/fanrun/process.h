// One child process: spawned by fork+exec with only async-signal-safe calls between
// the two, tied to its parent's life, watched through a pidfd, reaped by its owner.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "fanrun/fd.h"
#include "fanrun/status.h"

namespace fanrun {

struct SpawnOptions {
  // argv[0] is looked up in the PATH of `env` when it has no '/'.
  std::vector<std::string> argv;
  // The file to run when it is not argv[0].
  std::string executable;
  // The whole environment of the child, "NAME=value" each.
  std::vector<std::string> env;
  // Empty: the parent's working directory.
  std::string cwd;
  // Descriptors placed at 0, 1, 2 and kControlFd (3, run_contract.h) in the child; -1 gives /dev/null at 0,
  // leaves 1 and 2 as the parent's and 3 closed.
  int stdin_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
  int control_fd = -1;
  // The signal the child gets when the thread that spawned it ends (SIGKILL by
  // default): no child outlives its caller, even one killed with SIGKILL.
  int parent_death_signal = 9;
};

struct ExitStatus {
  int exit_code = -1;    // when the process exited
  int term_signal = 0;   // when a signal ended it
  // When its end was seen: by its reaper, or for a kept program by its keeper, whose report may
  // reach the owner much later.
  std::chrono::steady_clock::time_point ended_at{};
  bool success() const { return term_signal == 0 && exit_code == 0; }
  // "exited with code 3", "was killed by SIGKILL".
  std::string Describe() const;
};

// The name of a signal as users know it: "SIGKILL", or "signal 42".
std::string SignalName(int signo);

class ChildProcess {
 public:
  ChildProcess(pid_t pid, FileDescriptor pidfd) : pid_(pid), pidfd_(std::move(pidfd)) {}
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&&) = delete;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  // A child not yet reaped is killed with its process group and reaped: the owner
  // reaps, and nothing outlives a forgotten ChildProcess.
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // Readable once the child has exited.
  int pidfd() const { return pidfd_.fd(); }
  bool reaped() const { return reaped_; }

  // Sends to the child's whole process group, so that what the child started goes too.
  Status SignalGroup(int signo) const;
  Status Signal(int signo) const;
  // Reaps the child if it has exited; nullopt while it runs.
  Result<std::optional<ExitStatus>> TryReap();
  // Blocks until the child exits.
  Result<ExitStatus> Wait();

 private:
  Result<std::optional<ExitStatus>> Reap(int options);

  pid_t pid_;
  FileDescriptor pidfd_;
  bool reaped_ = false;
};

Result<ChildProcess> Spawn(const SpawnOptions& options);

// What `argv0` resolves to in the PATH of `env`: the path exec will run.
Result<std::string> ResolveExecutable(const std::string& argv0, const std::vector<std::string>& env);

}  // namespace fanrun
