// Starting, signalling and reaping a program through its rank keeper.
#include "fanrun/kept_process.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "process/keeper_protocol_internal.h"

namespace fanrun {
namespace {

// The keeper gives what is left 10 s to die after SIGKILL; beyond this it is stuck itself.
constexpr int kKeeperExitWaitMs = 15000;

// The keeper's first report: kStarted with the program's pid, or why it could not start. With
// no report at all (the keeper ended first), *silent is set.
Result<pid_t> ReadStarted(int channel, const std::string& what, bool* silent) {
  char packet[keeper::kMaxPacket];
  ssize_t got;
  do {
    got = ::recv(channel, packet, sizeof(packet), 0);
  } while (got < 0 && errno == EINTR);
  keeper::Report report{};
  if (got >= static_cast<ssize_t>(sizeof(report))) std::memcpy(&report, packet, sizeof(report));
  if (report.kind == keeper::ReportKind::kStarted) return static_cast<pid_t>(report.value);
  if (report.kind == keeper::ReportKind::kStartFailed) {
    return Status(static_cast<StatusCode>(report.value),
                  std::string(packet + sizeof(report), static_cast<size_t>(got) - sizeof(report)));
  }
  *silent = true;
  return Status::IOError("fanrun's rank keeper ended before starting ", what);
}

}  // namespace

Result<KeptProcess> KeptProcess::Start(const std::string& keeper, const SpawnOptions& options) {
  if (options.argv.empty()) return Status::Invalid("Cannot spawn a process with an empty argv");
  // Resolved here, so that a missing program is reported as plainly as without a keeper.
  FANRUN_ASSIGN_OR_RETURN(std::string path, ResolveExecutable(options.executable.empty() ? options.argv[0] : options.executable,
                                                              options.env));
  int sockets[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sockets) != 0) {
    return DescriptorError(errno, "Failed to create a rank keeper's socket");
  }
  FileDescriptor ours(sockets[0]), theirs(sockets[1]);
  SpawnOptions spawn = options;
  spawn.executable = keeper;
  // The keeper changes directory for the program, so that a bad one is reported as the program's.
  spawn.cwd.clear();
  spawn.argv = {keeper, std::to_string(::getpid()), options.cwd, path};
  spawn.argv.insert(spawn.argv.end(), options.argv.begin(), options.argv.end());
  spawn.stdin_fd = theirs.fd();
  spawn.parent_death_signal = SIGHUP;
  auto started = Spawn(spawn);
  if (!started.ok()) {
    return Status(started.status().code(), "fanrun's rank keeper could not start: " + started.status().message());
  }
  ChildProcess child = std::move(started).ValueOrDie();
  FANRUN_RETURN_NOT_OK(theirs.Close());
  bool silent = false;
  Result<pid_t> program = ReadStarted(ours.fd(), "'" + path + "'", &silent);
  if (program.ok()) return KeptProcess(std::move(child), std::move(ours), *program);
  FANRUN_ASSIGN_OR_RETURN(ExitStatus keeper_exit, child.Wait());
  if (!silent) return program.status();
  return Status::IOError("fanrun's rank keeper ", keeper_exit.Describe(), " before starting '", path, "'");
}

Result<KeptProcess> KeptProcess::Adopt(pid_t keeper_pid, FileDescriptor channel) {
  // Opened before its report is read: while it has not reported, the keeper is alive, so this
  // pid is still its own.
  FileDescriptor pidfd(static_cast<int>(::syscall(SYS_pidfd_open, keeper_pid, 0)));
  if (!pidfd.valid()) return DescriptorError(errno, "pidfd_open failed for a forked spare's keeper");
  bool silent = false;
  FANRUN_ASSIGN_OR_RETURN(pid_t program, ReadStarted(channel.fd(), "a forked spare rank", &silent));
  return KeptProcess(std::move(pidfd), std::move(channel), program);
}

KeptProcess::~KeptProcess() {
  if (reaped()) return;
  KillAll();
  pollfd p{pidfd(), POLLIN, 0};
  if (::poll(&p, 1, kKeeperExitWaitMs) != 1) {
    if (keeper_) {
      FANRUN_WARN_NOT_OK(keeper_->Signal(SIGKILL), "killing a rank keeper that did not exit");
    } else {
      ::syscall(SYS_pidfd_send_signal, pidfd(), SIGKILL, nullptr, 0U);
    }
  }
  FANRUN_WARN_NOT_OK(Wait().status(), "reaping a rank keeper");
}

Status KeptProcess::Send(int signo, bool all) const {
  if (reaped() || !channel_.valid()) return Status::OK();
  const keeper::Command command{signo, all ? keeper::Scope::kAll : keeper::Scope::kProgram};
  if (::send(channel_.fd(), &command, sizeof(command), MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EPIPE &&
      errno != ECONNRESET) {
    // EPIPE: the keeper has already left, with the program and all it started.
    return Status::IOErrorFromErrno(errno, "Failed to ask the keeper of pid ", pid_, " for ", SignalName(signo));
  }
  return Status::OK();
}

Status KeptProcess::Signal(int signo) const { return Send(signo, false); }

Status KeptProcess::SignalAll(int signo) const { return Send(signo, true); }

void KeptProcess::KillAll() {
  // Closing the sending side is the order to kill everything; the reports can still be read.
  if (channel_.valid()) ::shutdown(channel_.fd(), SHUT_WR);
}

ExitStatus KeptProcess::ProgramExit(const ExitStatus& keeper_exit) const {
  char packet[keeper::kMaxPacket];
  keeper::Report report{};
  while (::recv(channel_.fd(), packet, sizeof(packet), MSG_DONTWAIT) >= static_cast<ssize_t>(sizeof(report))) {
    std::memcpy(&report, packet, sizeof(report));
    if (report.kind == keeper::ReportKind::kEnded) {
      ExitStatus exit;
      exit.exit_code = report.signal != 0 ? -1 : report.value;
      exit.term_signal = report.signal;
      exit.ended_at = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(report.ended_ns));
      return exit;
    }
  }
  // No report: the keeper was killed itself, and the program by its parent-death signal.
  return keeper_exit;
}

Result<std::optional<ExitStatus>> KeptProcess::AdoptedEnd(int timeout_ms) {
  if (reaped()) return Status::Invalid("the keeper of pid ", pid_, " was already reaped");
  pollfd p{adopted_pidfd_.fd(), POLLIN, 0};
  int polled;
  do {
    polled = ::poll(&p, 1, timeout_ms);
  } while (polled < 0 && errno == EINTR);
  if (polled < 0) return Status::IOErrorFromErrno(errno, "Failed to wait for the keeper of pid ", pid_);
  if (polled == 0) return std::optional<ExitStatus>();
  adopted_ended_ = true;
  // Without a report, the keeper itself was killed, and the program with everything it started.
  ExitStatus killed;
  killed.term_signal = SIGKILL;
  killed.ended_at = std::chrono::steady_clock::now();
  return std::optional<ExitStatus>(ProgramExit(killed));
}

Result<std::optional<ExitStatus>> KeptProcess::TryReap() {
  if (!keeper_) return AdoptedEnd(0);
  FANRUN_ASSIGN_OR_RETURN(std::optional<ExitStatus> keeper_exit, keeper_->TryReap());
  if (!keeper_exit) return keeper_exit;
  return std::optional<ExitStatus>(ProgramExit(*keeper_exit));
}

Result<ExitStatus> KeptProcess::Wait() {
  if (!keeper_) {
    FANRUN_ASSIGN_OR_RETURN(std::optional<ExitStatus> end, AdoptedEnd(-1));
    return *end;
  }
  FANRUN_ASSIGN_OR_RETURN(ExitStatus keeper_exit, keeper_->Wait());
  return ProgramExit(keeper_exit);
}

}  // namespace fanrun
