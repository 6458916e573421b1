// Tests of spare zygotes: spares forked from one interpreter, each under a keeper of its own,
// supervised like spares started by exec, and outliving the zygote.
#include "fanrun/spare_zygote.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "spare/spare_test_program_internal.h"
#include "supervisor/supervisor_test_fixture_internal.h"

namespace fanrun {
namespace {

using testing::MinimalEnv;
using testing::ProcessGoneWithin;

// A zygote as small as can be: "imports" for 0.3 s, says it is ready, then forks for each
// request as _rank/zygote.py does. The spare it forks takes its call
// (spare_test_program_internal.h), given as the zygote's first argument.
constexpr const char* kZygoteProgram = R"(
import os, signal, socket, sys, time
time.sleep(0.3)
os.write(3, b"ready\n")
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
channel = socket.socket(fileno=3)
while True:
    data, fds, _, _ = socket.recv_fds(channel, 4096, 2)
    if not data:
        os._exit(0)
    keeper = data[len(b"fork "):-1].decode()
    pid = os.fork()
    if pid:
        os.close(fds[0]); os.close(fds[1])
        channel.sendall(b"%d\n" % pid)
        continue
    channel.detach()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)
    spare = os.fork()
    if spare == 0:
        os.dup2(fds[1], 3)
        exec(sys.argv[1], {})
    os.dup2(fds[0], 0)
    os.close(fds[0]); os.close(fds[1]); os.close(3)
    os.execv(keeper, [keeper, "--adopt", str(spare)])
)";

class SpareZygoteTest : public testing::SupervisorFixture {
 protected:
  static SpawnOptions ZygoteOptions() {
    SpawnOptions spawn;
    spawn.argv = {"python3", "-c", kZygoteProgram, testing::kTakeCallProgram};
    spawn.env = MinimalEnv();
    return spawn;
  }

  static SpareZygote StartZygote() {
    auto zygote = SpareZygote::Start(ZygoteOptions());
    EXPECT_TRUE(zygote.ok()) << zygote.status().message();
    auto ready = zygote->WaitReady(10);
    EXPECT_TRUE(ready.ok() && *ready);
    return std::move(zygote).ValueOrDie();
  }

  // The parent of `pid`, from /proc.
  static pid_t ParentOf(pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    return static_cast<pid_t>(std::stol(text.substr(text.rfind(')') + 4)));
  }
};

TEST_F(SpareZygoteTest, AForkedSpareBecomesTheRankItIsHandedUnderAKeeperOfItsOwn) {
  SpareZygote zygote = StartZygote();
  auto spare = zygote.Fork(testing::KeeperPath());
  ASSERT_TRUE(spare.ok()) << spare.status().message();
  const pid_t spare_pid = spare->pid();
  EXPECT_TRUE(spare->waiting());
  auto ready = spare->WaitReady(0);
  ASSERT_TRUE(ready.ok());
  EXPECT_TRUE(*ready);  // the zygote did its imports: it is ready at once
  const pid_t keeper = ParentOf(spare_pid);
  EXPECT_EQ(ParentOf(keeper), zygote.pid());
  std::vector<SpareRank> spares;
  spares.push_back(std::move(spare).ValueOrDie());
  auto supervisor = Supervisor::Start(Options({"echo out$RANK; echo err$RANK >&2; exit 3"}), std::move(spares));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  const auto events = RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->pid(0), spare_pid);
  std::string out, err;
  for (const auto& e : events) {
    if (e.kind == EventKind::kOutput) (e.stream == Stream::kStdout ? out : err) += e.text;
  }
  EXPECT_EQ(out, "out0");
  EXPECT_EQ(err, "err0");
  // How it ended comes from its keeper's report: not our child, it cannot be waited for.
  EXPECT_EQ((*supervisor)->exit_status(0)->exit_code, 3);
  EXPECT_TRUE(ProcessGoneWithin(keeper, 5000));
}

TEST_F(SpareZygoteTest, ItsSparesOutliveItAndTakeTheirCalls) {
  std::vector<SpareRank> spares;
  {
    SpareZygote zygote = StartZygote();
    for (int i = 0; i < 2; ++i) {
      auto spare = zygote.Fork(testing::KeeperPath());
      ASSERT_TRUE(spare.ok()) << spare.status().message();
      spares.push_back(std::move(spare).ValueOrDie());
    }
    const pid_t zygote_pid = zygote.pid();
    ASSERT_TRUE(zygote.Kill().ok());
    EXPECT_FALSE(zygote.Fork(testing::KeeperPath()).ok());
    EXPECT_TRUE(ProcessGoneWithin(zygote_pid, 5000));
  }
  for (const SpareRank& spare : spares) EXPECT_TRUE(spare.waiting());
  auto supervisor = Supervisor::Start(Options({"echo a", "echo b"}), std::move(spares));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  RunToEnd(**supervisor);
  for (int rank : {0, 1}) EXPECT_TRUE((*supervisor)->exit_status(rank)->success());
}

TEST_F(SpareZygoteTest, ADroppedForkedSpareEndsWithItsKeeper) {
  SpareZygote zygote = StartZygote();
  pid_t spare_pid = 0, keeper = 0;
  {
    auto spare = zygote.Fork(testing::KeeperPath());
    ASSERT_TRUE(spare.ok()) << spare.status().message();
    spare_pid = spare->pid();
    keeper = ParentOf(spare_pid);
  }
  EXPECT_TRUE(ProcessGoneWithin(spare_pid, 5000));
  EXPECT_TRUE(ProcessGoneWithin(keeper, 5000));
  EXPECT_TRUE(zygote.alive());  // and it forks another
  EXPECT_TRUE(zygote.Fork(testing::KeeperPath()).ok());
}

TEST_F(SpareZygoteTest, ForksOnlyOnceItsImportsAreDone) {
  auto zygote = SpareZygote::Start(ZygoteOptions());
  ASSERT_TRUE(zygote.ok()) << zygote.status().message();
  auto early = zygote->Fork(testing::KeeperPath());
  ASSERT_FALSE(early.ok());
  EXPECT_NE(early.status().message().find("has not finished its imports"), std::string::npos);
}

// fanrun-keeper --adopt of a pid that is not its child (none, or this test's own process):
// reported, neither kept nor killed.
class AdoptedKeeperTest : public SpareZygoteTest, public ::testing::WithParamInterface<bool> {};

TEST_P(AdoptedKeeperTest, AKeeperGivenNoChildOfItsOwnSaysSoAndKillsNothing) {
  const std::string pid = GetParam() ? std::to_string(::getpid()) : "0";
  int sockets[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sockets), 0);
  FileDescriptor ours(sockets[0]), theirs(sockets[1]);
  SpawnOptions spawn;
  spawn.argv = {testing::KeeperPath(), "--adopt", pid};
  spawn.env = MinimalEnv();
  spawn.stdin_fd = theirs.fd();
  auto keeper = Spawn(spawn);
  ASSERT_TRUE(keeper.ok()) << keeper.status().message();
  ASSERT_TRUE(theirs.Close().ok());
  auto adopted = KeptProcess::Adopt(keeper->pid(), std::move(ours));
  ASSERT_FALSE(adopted.ok());
  if (GetParam()) {
    EXPECT_NE(adopted.status().message().find("is not this keeper's child"), std::string::npos);
  }
  auto exit = keeper->Wait();
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->exit_code, 127);
}

INSTANTIATE_TEST_SUITE_P(NoneOrAnother, AdoptedKeeperTest, ::testing::Bool());

}  // namespace
}  // namespace fanrun
