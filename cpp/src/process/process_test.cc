// Tests of spawning, signalling and reaping one child.
#include "fanrun/process.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

using testing::MinimalEnv;
using testing::ProcessGoneWithin;
using testing::ShellCommand;

// Runs `script` with its stdout on a pipe; returns what it printed and how it ended.
std::pair<std::string, ExitStatus> RunCapture(const std::string& script, std::vector<std::string> env = MinimalEnv(),
                                              const std::string& cwd = "") {
  auto pipe = MakePipe();
  EXPECT_TRUE(pipe.ok());
  SpawnOptions options;
  options.argv = ShellCommand(script);
  options.env = std::move(env);
  options.cwd = cwd;
  options.stdout_fd = pipe->write.fd();
  auto child = Spawn(options);
  EXPECT_TRUE(child.ok()) << child.status().message();
  EXPECT_TRUE(pipe->write.Close().ok());
  std::string out;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(pipe->read.fd(), buffer, sizeof(buffer))) > 0) out.append(buffer, static_cast<size_t>(n));
  auto status = child->Wait();
  EXPECT_TRUE(status.ok());
  return {out, *status};
}

TEST(SpawnTest, RunsWithTheGivenEnvironmentAndDirectory) {
  auto [out, status] = RunCapture("echo \"$FANRUN_X\"; pwd", {"PATH=/usr/bin:/bin", "FANRUN_X=hello"}, "/tmp");
  EXPECT_TRUE(status.success());
  EXPECT_EQ(out, "hello\n/tmp\n");
}

TEST(SpawnTest, ReportsExitCodeAndSignal) {
  EXPECT_EQ(RunCapture("exit 3").second.exit_code, 3);
  auto killed = RunCapture("kill -KILL $$").second;
  EXPECT_EQ(killed.term_signal, SIGKILL);
  EXPECT_EQ(killed.Describe(), "was killed by SIGKILL");
  EXPECT_EQ(RunCapture("exit 3").second.Describe(), "exited with code 3");
}

TEST(SpawnTest, StdinIsDevNullAndNoStrayDescriptorsLeak) {
  // A descriptor without close-on-exec, as careless libraries leave them.
  const int leaked = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(leaked, 0);
  auto [out, status] = RunCapture("readlink /proc/self/fd/0; ls /proc/self/fd | sort -n | tr '\\n' ' '");
  ::close(leaked);
  EXPECT_TRUE(status.success());
  // 0, 1, 2, and the descriptor ls opens to read the directory.
  EXPECT_EQ(out.substr(0, out.find('\n')), "/dev/null");
  EXPECT_EQ(out.substr(out.find('\n') + 1), "0 1 2 3 ");
}

TEST(SpawnTest, MissingExecutableIsNotFoundBeforeAnythingRuns) {
  SpawnOptions options;
  options.argv = {"fanrun-no-such-program"};
  options.env = MinimalEnv();
  auto child = Spawn(options);
  ASSERT_FALSE(child.ok());
  EXPECT_EQ(child.status().code(), StatusCode::kNotFound);
  EXPECT_NE(child.status().message().find("not found in PATH"), std::string::npos);
}

TEST(SpawnTest, NonExecutableFileIsInvalid) {
  SpawnOptions options;
  options.argv = {"/etc/passwd"};
  options.env = MinimalEnv();
  auto child = Spawn(options);
  ASSERT_FALSE(child.ok());
  EXPECT_EQ(child.status().code(), StatusCode::kInvalid);
}

TEST(SpawnTest, BadWorkingDirectoryIsReportedFromTheChild) {
  SpawnOptions options;
  options.argv = ShellCommand("true");
  options.env = MinimalEnv();
  options.cwd = "/nonexistent-fanrun-dir";
  auto child = Spawn(options);
  ASSERT_FALSE(child.ok());
  EXPECT_NE(child.status().message().find("chdir"), std::string::npos);
}

TEST(SpawnTest, ChildLeadsItsOwnProcessGroupAndGroupSignalReachesGrandchildren) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  SpawnOptions options;
  options.argv = ShellCommand("sleep 100 & echo $!; wait");
  options.env = MinimalEnv();
  options.stdout_fd = pipe->write.fd();
  auto child = Spawn(options);
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(pipe->write.Close().ok());
  char buffer[64] = {0};
  ASSERT_GT(::read(pipe->read.fd(), buffer, sizeof(buffer) - 1), 0);
  const pid_t grandchild = static_cast<pid_t>(std::stoi(buffer));
  EXPECT_EQ(::getpgid(grandchild), child->pid());
  ASSERT_TRUE(child->SignalGroup(SIGKILL).ok());
  EXPECT_EQ(child->Wait()->term_signal, SIGKILL);
  EXPECT_TRUE(ProcessGoneWithin(grandchild, 5000));
}

TEST(SpawnTest, ChildDiesWhenItsParentIsKilled) {
  // An intermediate process spawns a long sleeper, reports its pid, then is killed.
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  const pid_t middle = ::fork();
  ASSERT_GE(middle, 0);
  if (middle == 0) {
    SpawnOptions options;
    options.argv = ShellCommand("exec sleep 100");
    options.env = MinimalEnv();
    auto child = Spawn(options);
    const pid_t pid = child.ok() ? child->pid() : -1;
    (void)!::write(pipe->write.fd(), &pid, sizeof(pid));
    ::pause();
    ::_exit(0);
  }
  ASSERT_TRUE(pipe->write.Close().ok());
  pid_t sleeper = -1;
  ASSERT_EQ(::read(pipe->read.fd(), &sleeper, sizeof(sleeper)), static_cast<ssize_t>(sizeof(sleeper)));
  ASSERT_GT(sleeper, 0);
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, sleeper, 0));
  ASSERT_GE(pidfd, 0);
  ::kill(middle, SIGKILL);
  ::waitpid(middle, nullptr, 0);
  pollfd p{pidfd, POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 5000), 1) << "the sleeper outlived its killed parent";
  ::close(pidfd);
}

TEST(SpawnTest, DroppingAChildKillsAndReapsIt) {
  pid_t pid;
  {
    SpawnOptions options;
    options.argv = ShellCommand("exec sleep 100");
    options.env = MinimalEnv();
    auto child = Spawn(options);
    ASSERT_TRUE(child.ok());
    pid = child->pid();
  }
  // Reaped: not even a zombie is left.
  EXPECT_EQ(::kill(pid, 0), -1);
  EXPECT_EQ(errno, ESRCH);
}

TEST(SpawnTest, StandardInputAndTheFileToRunCanBeGiven) {
  auto input = MakePipe();
  ASSERT_TRUE(input.ok());
  ASSERT_TRUE(WriteAll(input->write.fd(), "from stdin\n", 11).ok());
  ASSERT_TRUE(input->write.Close().ok());
  auto output = MakePipe();
  ASSERT_TRUE(output.ok());
  SpawnOptions options;
  options.executable = "/bin/sh";
  options.argv = {"a-name-of-its-own", "-c", "echo $0; cat"};
  options.env = MinimalEnv();
  options.stdin_fd = input->read.fd();
  options.stdout_fd = output->write.fd();
  auto child = Spawn(options);
  ASSERT_TRUE(child.ok()) << child.status().message();
  ASSERT_TRUE(output->write.Close().ok());
  char buffer[64] = {0};
  std::string out;
  ssize_t n;
  while ((n = ::read(output->read.fd(), buffer, sizeof(buffer))) > 0) out.append(buffer, static_cast<size_t>(n));
  EXPECT_TRUE(child->Wait()->success());
  EXPECT_EQ(out, "a-name-of-its-own\nfrom stdin\n");
}

TEST(SpawnTest, RunningOutOfDescriptorsNamesTheLimit) {
  // In a child process, whose limit can be lowered without harming the test runner.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = 40;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(2);
    SpawnOptions options;
    options.argv = ShellCommand("true");
    options.env = MinimalEnv();
    auto child = Spawn(options);
    const std::string message = child.ok() ? "" : child.status().message();
    std::fprintf(stderr, "%s\n", message.c_str());
    const bool named = message.find("RLIMIT_NOFILE") != std::string::npos &&
                       message.find("at most 40 open") != std::string::npos &&
                       message.find("ulimit -n") != std::string::npos;
    ::_exit(named ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the error did not name the descriptor limit";
}

TEST(SignalNameTest, KnownAndUnknownSignals) {
  EXPECT_EQ(SignalName(SIGKILL), "SIGKILL");
  EXPECT_EQ(SignalName(SIGSEGV), "SIGSEGV");
  EXPECT_EQ(SignalName(1000), "signal 1000");
}

}  // namespace
}  // namespace fanrun
