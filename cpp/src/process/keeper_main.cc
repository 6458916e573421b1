// fanrun-keeper: runs one rank's program as its child, as a child subreaper, so that every
// process the program starts stays its descendant, in whatever process group or session.
// When the program ends, or its owner says so or goes away, it kills every descendant,
// reaps them, reports how the program ended and leaves: no process of a run outlives it.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fanrun/fd.h"
#include "fanrun/process.h"
#include "fanrun/run_contract.h"
#include "process/keeper_protocol_internal.h"

extern char** environ;

namespace fanrun::keeper {
namespace {

constexpr int kChannel = 0;  // the socket to the owner
// How long what is left gets to die after SIGKILL (a process stuck in the kernel dies only when
// it leaves it) before the keeper reports anyway rather than hold up the caller.
constexpr auto kKillDeadline = std::chrono::seconds(10);

std::string ReadSmallFile(const std::string& path) {
  std::string text;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return text;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) text.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  return text;
}

std::vector<std::string> NumericEntries(const std::string& directory) {
  std::vector<std::string> names;
  Result<DirectoryListing> listing = DirectoryListing::Open(directory);
  if (!listing.ok()) return names;
  while (const char* name = listing->Next()) {
    if (std::isdigit(static_cast<unsigned char>(name[0]))) names.emplace_back(name);
  }
  return names;
}

// The processes below this one, found through /proc.
class ProcessTree {
 public:
  std::vector<pid_t> Descendants() const {
    std::map<pid_t, std::vector<pid_t>> scanned;
    if (!children_lists_) scanned = ScanChildren();
    std::vector<pid_t> found;
    std::vector<pid_t> pending{::getpid()};
    while (!pending.empty()) {
      const pid_t pid = pending.back();
      pending.pop_back();
      for (pid_t child : children_lists_ ? ChildrenFromLists(pid) : scanned[pid]) {
        // A pid seen twice (a child that moved to us while we walked) is walked once.
        if (std::find(found.begin(), found.end(), child) != found.end()) continue;
        found.push_back(child);
        pending.push_back(child);
      }
    }
    return found;
  }

 private:
  // Every thread's list of children: a process may fork from any of its threads.
  static std::vector<pid_t> ChildrenFromLists(pid_t pid) {
    std::vector<pid_t> children;
    const std::string tasks = "/proc/" + std::to_string(pid) + "/task/";
    for (const std::string& tid : NumericEntries(tasks)) {
      const std::string text = ReadSmallFile(tasks + tid + "/children");
      const char* cursor = text.c_str();
      char* end = nullptr;
      for (long value = std::strtol(cursor, &end, 10); end != cursor; value = std::strtol(cursor, &end, 10)) {
        children.push_back(static_cast<pid_t>(value));
        cursor = end;
      }
    }
    return children;
  }

  // Without the kernel's lists (CONFIG_PROC_CHILDREN), every process's parent from its stat.
  static std::map<pid_t, std::vector<pid_t>> ScanChildren() {
    std::map<pid_t, std::vector<pid_t>> children;
    for (const std::string& name : NumericEntries("/proc")) {
      const std::string stat = ReadSmallFile("/proc/" + name + "/stat");
      // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last ')'.
      const size_t close = stat.rfind(')');
      if (close == std::string::npos || close + 4 >= stat.size()) continue;
      const pid_t parent = static_cast<pid_t>(std::strtol(stat.c_str() + close + 4, nullptr, 10));
      children[parent].push_back(static_cast<pid_t>(std::strtol(name.c_str(), nullptr, 10)));
    }
    return children;
  }

  const bool children_lists_ = ::access("/proc/thread-self/children", F_OK) == 0;
};

class Keeper {
 public:
  // owner 0: the channel's end alone says that the owner is gone.
  explicit Keeper(pid_t owner) : owner_(owner) {}
  int Run(const char* directory, const char* path, char** argv);
  int RunAdopted(pid_t program);

 private:
  Status Prepare();
  Status Start(const char* directory, const char* path, char** argv);
  int Keep();
  void Apply(const Command& command);
  void ReadSignals();
  bool ReapExited();
  void SignalDescendants(int signo);
  void KillEverything();
  void Send(ReportKind kind, int32_t value, int32_t signal, const std::string& text = "",
            std::chrono::steady_clock::time_point ended_at = {});
  // Parent-death signals come as SIGHUP; a SIGHUP, SIGTERM or SIGINT from anyone else (a
  // scheduler signalling every process of a job) is the program's to handle, not the keeper's.
  bool OwnerGone() const { return owner_ != 0 && ::getppid() != owner_; }

  const pid_t owner_;
  bool control_ = false;
  FileDescriptor signals_;
  std::optional<ChildProcess> program_;
  std::optional<ExitStatus> program_exit_;
  bool stop_ = false;
  ProcessTree tree_;
};

int Keeper::Run(const char* directory, const char* path, char** argv) {
  // Before the keeper opens anything, which could take number 3 when no channel is there.
  control_ = ::fcntl(kControlFd, F_GETFD) >= 0;  // the rank's control channel, handed on to the program
  Status st = Prepare();
  if (st.ok() && OwnerGone()) return 1;  // before the parent-death signal was armed: nothing started yet
  if (st.ok()) st = Start(directory, path, argv);
  if (!st.ok()) {
    Send(ReportKind::kStartFailed, static_cast<int32_t>(st.code()), 0, st.message());
    return 127;
  }
  Send(ReportKind::kStarted, program_->pid(), 0);
  return Keep();
}

int Keeper::RunAdopted(pid_t program) {
  Status st = Prepare();
  FileDescriptor pidfd(static_cast<int>(::syscall(SYS_pidfd_open, program, 0)));
  if (st.ok() && !pidfd.valid()) st = DescriptorError(errno, "fanrun-keeper: pidfd_open of the adopted program");
  // Only its own child: a pid given by hand names a process this keeper must neither wait for
  // nor kill.
  siginfo_t info{};
  if (st.ok() && ::waitid(P_PID, static_cast<id_t>(program), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
    st = Status::Invalid("fanrun-keeper --adopt: pid ", program, " is not this keeper's child");
  }
  if (!st.ok()) {
    Send(ReportKind::kStartFailed, static_cast<int32_t>(st.code()), 0, st.message());
    return 127;
  }
  program_.emplace(program, std::move(pidfd));
  Send(ReportKind::kStarted, program, 0);
  // It may have ended before the signals were blocked: that SIGCHLD is not coming again.
  ReapExited();
  return Keep();
}

int Keeper::Keep() {
  while (!program_exit_ && !stop_) {
    pollfd fds[2] = {{kChannel, POLLIN, 0}, {signals_.fd(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents != 0) {
      Command command{};
      const ssize_t n = ::recv(kChannel, &command, sizeof(command), MSG_DONTWAIT);
      if (n == static_cast<ssize_t>(sizeof(command))) {
        Apply(command);
      } else if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        stop_ = true;  // the owner closed its side, or died: everything goes
      }
    }
    if (fds[1].revents != 0) {
      ReadSignals();
      ReapExited();
    }
  }
  KillEverything();
  if (!program_exit_) {
    // The program outlived its SIGKILL by the whole deadline: its keeper ends the same way,
    // and the kernel delivers the program's own parent-death SIGKILL.
    ::kill(::getpid(), SIGKILL);
  }
  // With when it ended: killing what it left can take long, and its owner tells a death that
  // caused a peer's failure from one that followed it by that time, not by this report's.
  Send(ReportKind::kEnded, program_exit_->exit_code, program_exit_->term_signal, "", program_exit_->ended_at);
  return 0;
}

Status Keeper::Prepare() {
  // A vanished owner shows on the socket; a write to it must not kill the keeper.
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t handled;
  ::sigemptyset(&handled);
  for (int signo : {SIGCHLD, SIGHUP, SIGINT, SIGTERM, SIGQUIT}) ::sigaddset(&handled, signo);
  if (::sigprocmask(SIG_BLOCK, &handled, nullptr) != 0) return Status::IOErrorFromErrno(errno, "sigprocmask");
  signals_ = FileDescriptor(::signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!signals_.valid()) return DescriptorError(errno, "fanrun-keeper: signalfd");
  // Every process the program leaves without a parent comes to the keeper, not to init.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) {
    return Status::IOErrorFromErrno(errno, "fanrun-keeper: prctl(PR_SET_CHILD_SUBREAPER)");
  }
  return Status::OK();
}

Status Keeper::Start(const char* directory, const char* path, char** argv) {
  SpawnOptions options;
  options.executable = path;
  options.cwd = directory;
  for (char** arg = argv; *arg != nullptr; ++arg) options.argv.emplace_back(*arg);
  for (char** entry = environ; *entry != nullptr; ++entry) options.env.emplace_back(*entry);
  options.stdout_fd = 1;
  options.stderr_fd = 2;
  if (control_) options.control_fd = kControlFd;
  FANRUN_ASSIGN_OR_RETURN(ChildProcess child, Spawn(options));
  program_.emplace(std::move(child));
  if (control_) ::close(kControlFd);  // the channel's end of the rank is the program's alone
  return Status::OK();
}

void Keeper::Apply(const Command& command) {
  if (!program_ || program_->reaped()) return;
  if (command.scope == Scope::kProgram) {
    FANRUN_WARN_NOT_OK(program_->Signal(command.signo), "fanrun-keeper: signalling the rank");
  } else {
    SignalDescendants(command.signo);
  }
}

void Keeper::ReadSignals() {
  signalfd_siginfo info;
  while (::read(signals_.fd(), &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
    if (info.ssi_signo != SIGCHLD && OwnerGone()) stop_ = true;
  }
}

// Reaps every child that has ended, the program and what it left behind alike; false once the
// keeper has no child left at all.
bool Keeper::ReapExited() {
  for (;;) {
    siginfo_t info{};
    // WNOWAIT: see who it is first, because the program is reaped through its ChildProcess.
    if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
      if (errno == EINTR) continue;
      return errno != ECHILD;
    }
    if (info.si_pid == 0) return true;
    if (program_ && !program_->reaped() && info.si_pid == program_->pid()) {
      auto exit = program_->TryReap();
      if (!exit.ok() || !*exit) return true;
      program_exit_ = **exit;
    } else {
      ::waitpid(info.si_pid, nullptr, 0);
    }
  }
}

void Keeper::SignalDescendants(int signo) {
  for (pid_t pid : tree_.Descendants()) ::kill(pid, signo);
}

void Keeper::KillEverything() {
  const auto deadline = std::chrono::steady_clock::now() + kKillDeadline;
  for (;;) {
    // Each round also kills what a dying process forked, or handed to us, since the last one.
    SignalDescendants(SIGKILL);
    if (!ReapExited()) return;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      std::fprintf(stderr, "fanrun-keeper: processes the rank started are still alive %lld s after SIGKILL\n",
                   static_cast<long long>(kKillDeadline.count()));
      return;
    }
    pollfd p{signals_.fd(), POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(left));  // woken by SIGCHLD
    ReadSignals();
  }
}

void Keeper::Send(ReportKind kind, int32_t value, int32_t signal, const std::string& text,
                  std::chrono::steady_clock::time_point ended_at) {
  char packet[kMaxPacket];
  Report report{};
  report.kind = kind;
  report.value = value;
  report.signal = signal;
  report.ended_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(ended_at.time_since_epoch()).count();
  std::memcpy(packet, &report, sizeof(report));
  const size_t length = std::min(text.size(), sizeof(packet) - sizeof(report));
  std::memcpy(packet + sizeof(report), text.data(), length);
  // An owner that is gone cannot be told: nothing else to do.
  (void)::send(kChannel, packet, sizeof(report) + length, MSG_NOSIGNAL);
}

}  // namespace
}  // namespace fanrun::keeper

int main(int argc, char** argv) {
  using namespace fanrun::keeper;
  if (argc == 3 && std::strcmp(argv[1], kAdoptArg) == 0) {
    ::_exit(Keeper(0).RunAdopted(static_cast<pid_t>(std::strtol(argv[2], nullptr, 10))));
  }
  if (argc <= kProgramArgs) {
    std::fprintf(stderr, "fanrun-keeper is started by fanrun's engine for each rank, not by hand\n");
    return 2;
  }
  const pid_t owner = static_cast<pid_t>(std::strtol(argv[kOwnerArg], nullptr, 10));
  // _exit: nothing is buffered, and the sanitizers' exit work would run in a process that
  // must leave as soon as it has reported.
  ::_exit(Keeper(owner).Run(argv[kDirectoryArg], argv[kPathArg], argv + kProgramArgs));
}
