// Tests of running a program under a rank keeper: nothing it starts outlives it or its owner.
#include "fanrun/kept_process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

using testing::KeeperPath;
using testing::MinimalEnv;
using testing::ProcessGoneWithin;
using testing::ShellCommand;

// Starts `sleep 100` three ways and prints each pid on a line of its own: a plain background
// child, one in a new session, and one whose parent exits at once (so it is orphaned).
constexpr const char* kStartSleepers =
    "sleep 100 & echo $!; setsid sleep 100 & echo $!; (setsid sleep 100 & echo $!); ";

std::vector<pid_t> Pids(const std::string& text) {
  std::vector<pid_t> pids;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) pids.push_back(static_cast<pid_t>(std::stoi(line)));
  return pids;
}

// Reads the program's stdout until `lines` lines have come.
std::string ReadLines(int fd, size_t lines) {
  std::string out;
  char c;
  while (static_cast<size_t>(std::count(out.begin(), out.end(), '\n')) < lines && ::read(fd, &c, 1) == 1) out += c;
  return out;
}

Result<KeptProcess> StartShell(const std::string& script, int stdout_fd, const std::string& cwd = "") {
  SpawnOptions options;
  options.argv = ShellCommand(script);
  options.env = MinimalEnv();
  options.env.push_back("FANRUN_X=kept");
  options.cwd = cwd;
  options.stdout_fd = stdout_fd;
  return KeptProcess::Start(KeeperPath(), options);
}

TEST(KeptProcessTest, RunsTheProgramWithItsEnvironmentDirectoryAndPid) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  auto kept = StartShell("echo $$; echo \"$FANRUN_X\"; pwd", pipe->write.fd(), "/tmp");
  ASSERT_TRUE(kept.ok()) << kept.status().message();
  ASSERT_TRUE(pipe->write.Close().ok());
  const std::string out = ReadLines(pipe->read.fd(), 3);
  EXPECT_EQ(out, std::to_string(kept->pid()) + "\nkept\n/tmp\n");
  auto status = kept->Wait();
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->success());
}

TEST(KeptProcessTest, TheProgramHasAControlChannelAtFd3OnlyWhenGivenOne) {
  const std::string script = "if [ -e /proc/$$/fd/3 ]; then echo open; else echo closed; fi";
  for (bool control : {false, true}) {
    auto out = MakePipe();
    auto channel = MakePipe();
    ASSERT_TRUE(out.ok() && channel.ok());
    SpawnOptions options;
    options.argv = ShellCommand(script);
    options.env = MinimalEnv();
    options.stdout_fd = out->write.fd();
    options.control_fd = control ? channel->write.fd() : -1;
    auto kept = KeptProcess::Start(KeeperPath(), options);
    ASSERT_TRUE(kept.ok()) << kept.status().message();
    ASSERT_TRUE(out->write.Close().ok());
    EXPECT_EQ(ReadLines(out->read.fd(), 1), control ? "open\n" : "closed\n");
    EXPECT_TRUE(kept->Wait()->success());
  }
}

TEST(KeptProcessTest, ReportsTheProgramsExitCodeAndSignal) {
  auto exited = StartShell("exit 3", -1);
  ASSERT_TRUE(exited.ok());
  EXPECT_EQ(exited->Wait()->Describe(), "exited with code 3");
  auto killed = StartShell("kill -KILL $$", -1);
  ASSERT_TRUE(killed.ok());
  EXPECT_EQ(killed->Wait()->Describe(), "was killed by SIGKILL");
}

TEST(KeptProcessTest, NothingTheProgramStartedOutlivesIt) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  auto kept = StartShell(std::string(kStartSleepers) + "exit 0", pipe->write.fd());
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(pipe->write.Close().ok());
  const auto pids = Pids(ReadLines(pipe->read.fd(), 3));
  ASSERT_EQ(pids.size(), 3u);
  auto status = kept->Wait();
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->success());
  // Gone, and reaped by the keeper, by the time the keeper has exited.
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGoneWithin(pid, 0)) << pid;
}

TEST(KeptProcessTest, SignalAllReachesProcessesInOtherSessions) {
  const std::string dir = testing::MakeTempDir("fanrun-kept-test");
  ASSERT_FALSE(dir.empty());
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  auto kept = StartShell(
      // The program outlives the SIGTERM by waiting for the one in the new session, which records it.
      "setsid sh -c 'trap \"echo term > " + dir + "/got; exit 0\" TERM; echo ready; while :; do sleep 0.05; done' & "
      "trap '' TERM; wait",
      pipe->write.fd());
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(pipe->write.Close().ok());
  ASSERT_EQ(ReadLines(pipe->read.fd(), 1), "ready\n");
  ASSERT_TRUE(kept->SignalAll(SIGTERM).ok());
  auto status = kept->Wait();
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->success());
  std::ifstream got(dir + "/got");
  std::string word;
  got >> word;
  EXPECT_EQ(word, "term");
  EXPECT_TRUE(testing::RemoveTree(dir));
}

TEST(KeptProcessTest, KillAllEndsAProgramThatIgnoresSigterm) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  auto kept = StartShell(std::string("trap '' TERM; ") + kStartSleepers + "wait", pipe->write.fd());
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(pipe->write.Close().ok());
  const auto pids = Pids(ReadLines(pipe->read.fd(), 3));
  kept->KillAll();
  auto status = kept->Wait();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->term_signal, SIGKILL);
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGoneWithin(pid, 0)) << pid;
}

TEST(KeptProcessTest, DroppingItEndsEverythingTheProgramStarted) {
  std::vector<pid_t> pids;
  {
    auto pipe = MakePipe();
    ASSERT_TRUE(pipe.ok());
    auto kept = StartShell(std::string(kStartSleepers) + "wait", pipe->write.fd());
    ASSERT_TRUE(kept.ok());
    ASSERT_TRUE(pipe->write.Close().ok());
    pids = Pids(ReadLines(pipe->read.fd(), 3));
    pids.push_back(kept->pid());
  }
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGoneWithin(pid, 0)) << pid;
}

TEST(KeptProcessTest, NothingOutlivesAnOwnerKilledBySigkill) {
  // An owner process starts the program, passes on the pids, and is killed.
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  const pid_t owner = ::fork();
  ASSERT_GE(owner, 0);
  if (owner == 0) {
    auto kept = StartShell(std::string("echo $$; ") + kStartSleepers + "wait", pipe->write.fd());
    if (!kept.ok()) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  ASSERT_TRUE(pipe->write.Close().ok());
  const auto pids = Pids(ReadLines(pipe->read.fd(), 4));
  ASSERT_EQ(pids.size(), 4u);
  ::kill(owner, SIGKILL);
  ::waitpid(owner, nullptr, 0);
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGoneWithin(pid, 5000)) << pid << " outlived its killed owner";
}

TEST(KeptProcessTest, AMissingProgramIsNotFoundBeforeAnythingRuns) {
  SpawnOptions options;
  options.argv = {"fanrun-no-such-program"};
  options.env = MinimalEnv();
  auto kept = KeptProcess::Start(KeeperPath(), options);
  ASSERT_FALSE(kept.ok());
  EXPECT_EQ(kept.status().code(), StatusCode::kNotFound);
}

TEST(KeptProcessTest, AStartFailureInTheKeeperIsReported) {
  SpawnOptions options;
  options.argv = ShellCommand("true");
  options.env = MinimalEnv();
  options.cwd = "/nonexistent-fanrun-dir";
  auto kept = KeptProcess::Start(KeeperPath(), options);
  ASSERT_FALSE(kept.ok());
  EXPECT_NE(kept.status().message().find("chdir"), std::string::npos) << kept.status().message();
  options.cwd.clear();
  auto missing = KeptProcess::Start("/nonexistent/fanrun-keeper", options);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("fanrun's rank keeper could not start"), std::string::npos);
}

}  // namespace
}  // namespace fanrun
