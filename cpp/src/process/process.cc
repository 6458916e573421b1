// Spawning and reaping child processes.
#include "fanrun/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "fanrun/run_contract.h"

namespace fanrun {
namespace {

// Sources are moved above this before fork so that dup2 onto 0..kControlFd never clobbers one.
constexpr int kHighFd = 64;

struct ExecFailure {
  int step;   // which call failed in the child
  int error;  // its errno
};

enum ChildStep { kStepPgid = 1, kStepDeathSignal, kStepParentGone, kStepDup, kStepChdir, kStepExec };

const char* DescribeStep(int step) {
  switch (step) {
    case kStepPgid: return "setpgid";
    case kStepDeathSignal: return "prctl(PR_SET_PDEATHSIG)";
    case kStepParentGone: return "parent check";
    case kStepDup: return "dup2";
    case kStepChdir: return "chdir";
    default: return "exec";
  }
}

bool IsExecutableFile(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// From here to exec the child may only make async-signal-safe calls: the parent
// can have threads (a Jupyter kernel always has), whose locks are frozen in the copy.
[[noreturn]] void RunChild(const SpawnOptions& options, const char* path, char* const* argv,
                           char* const* envp, pid_t parent, int stdin_fd, int stdout_fd,
                           int stderr_fd, int control_fd, int report_fd) {
  auto fail = [report_fd](int step) {
    ExecFailure failure{step, errno};
    ssize_t ignored = ::write(report_fd, &failure, sizeof(failure));
    (void)ignored;
    ::_exit(127);
  };
  if (::setpgid(0, 0) != 0) fail(kStepPgid);
  if (options.parent_death_signal != 0 &&
      ::prctl(PR_SET_PDEATHSIG, options.parent_death_signal, 0, 0, 0) != 0) {
    fail(kStepDeathSignal);
  }
  // The parent may have died before prctl took effect: then no signal will come.
  if (::getppid() != parent) {
    errno = ESRCH;
    fail(kStepParentGone);
  }
  if (::dup2(stdin_fd, 0) < 0) fail(kStepDup);
  if (stdout_fd >= 0 && ::dup2(stdout_fd, 1) < 0) fail(kStepDup);
  if (stderr_fd >= 0 && ::dup2(stderr_fd, 2) < 0) fail(kStepDup);
  if (control_fd >= 0 && ::dup2(control_fd, kControlFd) < 0) fail(kStepDup);
  // Close what the caller leaked without close-on-exec; keep the report pipe,
  // which closes itself at exec.
  const unsigned first_closed = static_cast<unsigned>(control_fd >= 0 ? kControlFd + 1 : kControlFd);
  ::syscall(SYS_close_range, first_closed, static_cast<unsigned>(report_fd - 1), 0U);
  ::syscall(SYS_close_range, static_cast<unsigned>(report_fd + 1), ~0U, 0U);
  if (!options.cwd.empty() && ::chdir(options.cwd.c_str()) != 0) fail(kStepChdir);
  // Python ignores SIGPIPE; a native program expects the default, as subprocess restores it.
  ::signal(SIGPIPE, SIG_DFL);
  sigset_t empty;
  ::sigemptyset(&empty);
  ::sigprocmask(SIG_SETMASK, &empty, nullptr);
  ::execve(path, argv, envp);
  fail(kStepExec);
  ::_exit(127);  // not reached
}

}  // namespace

// The names by hand rather than glibc's sigabbrev_np, which is 2.32's: the wheel's engine is
// built for glibc 2.28 (manylinux_2_28).
std::string SignalName(int signo) {
  static const struct {
    int signo;
    const char* name;
  } kNames[] = {
      {SIGHUP, "SIGHUP"},     {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"},     {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"},   {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},       {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"},   {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"},     {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"},   {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"},     {SIGCHLD, "SIGCHLD"},
      {SIGCONT, "SIGCONT"},   {SIGSTOP, "SIGSTOP"}, {SIGTSTP, "SIGTSTP"},     {SIGTTIN, "SIGTTIN"},
      {SIGTTOU, "SIGTTOU"},   {SIGURG, "SIGURG"},   {SIGXCPU, "SIGXCPU"},     {SIGXFSZ, "SIGXFSZ"},
      {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"}, {SIGWINCH, "SIGWINCH"}, {SIGPOLL, "SIGPOLL"},
      {SIGPWR, "SIGPWR"},     {SIGSYS, "SIGSYS"},
#ifdef SIGSTKFLT
      {SIGSTKFLT, "SIGSTKFLT"},
#endif
  };
  for (const auto& entry : kNames) {
    if (entry.signo == signo) return entry.name;
  }
  return internal::StrCat("signal ", signo);
}

std::string ExitStatus::Describe() const {
  if (term_signal != 0) return "was killed by " + SignalName(term_signal);
  return internal::StrCat("exited with code ", exit_code);
}

Result<std::string> ResolveExecutable(const std::string& argv0, const std::vector<std::string>& env) {
  if (argv0.empty()) return Status::Invalid("The command to run is empty");
  if (argv0.find('/') != std::string::npos) {
    if (!IsExecutableFile(argv0)) {
      if (::access(argv0.c_str(), F_OK) != 0) {
        return Status::NotFound("Cannot run '", argv0, "': no such file");
      }
      return Status::Invalid("Cannot run '", argv0, "': it is not an executable file (chmod +x?)");
    }
    return argv0;
  }
  std::string path_var = "/usr/local/bin:/usr/bin:/bin";
  for (const auto& entry : env) {
    if (entry.rfind("PATH=", 0) == 0) path_var = entry.substr(5);
  }
  size_t start = 0;
  while (start <= path_var.size()) {
    size_t end = path_var.find(':', start);
    if (end == std::string::npos) end = path_var.size();
    std::string dir = path_var.substr(start, end - start);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + argv0;
    if (IsExecutableFile(candidate)) return candidate;
    start = end + 1;
  }
  return Status::NotFound("Cannot run '", argv0, "': not found in PATH (", path_var, ")");
}

Result<ChildProcess> Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return Status::Invalid("Cannot spawn a process with an empty argv");
  FANRUN_ASSIGN_OR_RETURN(std::string path, ResolveExecutable(options.executable.empty() ? options.argv[0] : options.executable,
                                                              options.env));

  // Everything the child touches is built here, before fork: it may not allocate.
  std::vector<char*> argv;
  for (const auto& arg : options.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& entry : options.env) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);

  FileDescriptor stdin_fd;
  if (options.stdin_fd >= 0) {
    FANRUN_ASSIGN_OR_RETURN(stdin_fd, DuplicateAbove(options.stdin_fd, kHighFd));
  } else {
    FANRUN_ASSIGN_OR_RETURN(FileDescriptor dev_null, OpenFile("/dev/null", O_RDONLY));
    FANRUN_ASSIGN_OR_RETURN(stdin_fd, DuplicateAbove(dev_null.fd(), kHighFd));
  }
  FileDescriptor stdout_fd, stderr_fd, control_fd;
  if (options.stdout_fd >= 0) {
    FANRUN_ASSIGN_OR_RETURN(stdout_fd, DuplicateAbove(options.stdout_fd, kHighFd));
  }
  if (options.stderr_fd >= 0) {
    FANRUN_ASSIGN_OR_RETURN(stderr_fd, DuplicateAbove(options.stderr_fd, kHighFd));
  }
  if (options.control_fd >= 0) {
    FANRUN_ASSIGN_OR_RETURN(control_fd, DuplicateAbove(options.control_fd, kHighFd));
  }
  FANRUN_ASSIGN_OR_RETURN(Pipe report, MakePipe());
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor report_write, DuplicateAbove(report.write.fd(), kHighFd));
  FANRUN_RETURN_NOT_OK(report.write.Close());

  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Status::IOErrorFromErrno(errno, "Failed to fork to run '", path, "'");
  if (pid == 0) {
    RunChild(options, path.c_str(), argv.data(), envp.data(), parent, stdin_fd.fd(), stdout_fd.fd(),
             stderr_fd.fd(), control_fd.fd(), report_write.fd());
  }
  FANRUN_RETURN_NOT_OK(report_write.Close());

  // The report pipe closes at a successful exec; otherwise it carries what failed.
  ExecFailure failure{0, 0};
  ssize_t got;
  do {
    got = ::read(report.read.fd(), &failure, sizeof(failure));
  } while (got < 0 && errno == EINTR);
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  const int pidfd_errno = errno;
  ChildProcess child(pid, FileDescriptor(pidfd));
  if (got > 0) {
    auto reaped = child.Wait();
    (void)reaped;
    return Status::IOErrorFromErrno(failure.error, "Failed to start '", path, "' (",
                                    DescribeStep(failure.step), ")");
  }
  if (pidfd < 0) {
    // The ChildProcess destructor kills and reaps it.
    if (pidfd_errno == EMFILE || pidfd_errno == ENFILE) {
      return DescriptorError(pidfd_errno, internal::StrCat("pidfd_open failed for pid ", pid));
    }
    return Status::IOErrorFromErrno(pidfd_errno, "pidfd_open failed for pid ", pid,
                                    " (fanrun needs Linux 5.3 or newer)");
  }
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(other.pid_), pidfd_(std::move(other.pidfd_)), reaped_(other.reaped_) {
  other.reaped_ = true;
}

ChildProcess::~ChildProcess() {
  if (reaped_) return;
  FANRUN_WARN_NOT_OK(SignalGroup(SIGKILL), "killing a child being dropped");
  auto status = Wait();
  FANRUN_WARN_NOT_OK(status.status(), "reaping a child being dropped");
}

Status ChildProcess::SignalGroup(int signo) const {
  // The group outlives the child when the child left processes behind; its id is
  // the child's pid, which Linux does not reuse while the group exists.
  if (::kill(-pid_, signo) != 0 && errno != ESRCH) {
    return Status::IOErrorFromErrno(errno, "Failed to send ", SignalName(signo), " to process group ", pid_);
  }
  return Status::OK();
}

Status ChildProcess::Signal(int signo) const {
  if (reaped_) return Status::OK();
  if (::kill(pid_, signo) != 0 && errno != ESRCH) {
    return Status::IOErrorFromErrno(errno, "Failed to send ", SignalName(signo), " to pid ", pid_);
  }
  return Status::OK();
}

Result<std::optional<ExitStatus>> ChildProcess::Reap(int options) {
  if (reaped_) return Status::Invalid("pid ", pid_, " was already reaped");
  int raw = 0;
  pid_t got;
  do {
    got = ::waitpid(pid_, &raw, options);
  } while (got < 0 && errno == EINTR);
  if (got < 0) return Status::IOErrorFromErrno(errno, "waitpid failed for pid ", pid_);
  if (got == 0) return std::optional<ExitStatus>();
  reaped_ = true;
  ExitStatus status;
  status.ended_at = std::chrono::steady_clock::now();
  if (WIFSIGNALED(raw)) {
    status.term_signal = WTERMSIG(raw);
  } else {
    status.exit_code = WEXITSTATUS(raw);
  }
  return std::optional<ExitStatus>(status);
}

Result<std::optional<ExitStatus>> ChildProcess::TryReap() { return Reap(WNOHANG); }

Result<ExitStatus> ChildProcess::Wait() {
  FANRUN_ASSIGN_OR_RETURN(std::optional<ExitStatus> status, Reap(0));
  return *status;
}

}  // namespace fanrun
