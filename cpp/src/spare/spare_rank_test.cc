// Tests of spare ranks: handed a call, a spare runs as that rank, supervised like a cold one.
#include "fanrun/spare_rank.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include "spare/spare_test_program_internal.h"
#include "supervisor/supervisor_test_fixture_internal.h"

namespace fanrun {
namespace {

using testing::MinimalEnv;
using testing::ProcessGoneWithin;

// A spare as small as can be: it says it is ready after 0.3 s of "imports", then takes its call
// (spare_test_program_internal.h), given as its first argument.
constexpr const char* kSpareProgram = R"(
import os, sys, time
time.sleep(0.3)
os.write(3, b"ready\n")
exec(sys.argv[1], {})
)";
// A spare that keeps itself alive: for each call it writes its output, says "done", puts
// /dev/null at 1 and 2, says "kept" and waits for the next call; the end of its channel ends it.
// A call whose script is "fail" fails instead.
constexpr const char* kKeptProgram = R"(
import os, socket
channel = socket.socket(fileno=3)
while True:
    data, fds, _, _ = socket.recv_fds(channel, 65536, 2)
    if not data:
        raise SystemExit(0)
    head, _, body = data.partition(b"\n")
    while len(body) < int(head[5:]):
        body += channel.recv(65536)
    fields = body.split(b"\0")[:-1]
    count = int(fields[1])
    script = fields[2 + count - 1]
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.close(fds[0])
    os.close(fds[1])
    if script == b"fail":
        os.write(3, b"failed\n")
        raise SystemExit(1)
    os.write(1, b"call in pid %d\n" % os.getpid())
    os.write(3, b"done\n")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.write(3, b"kept\n")
)";

// A spare whose failed calls keep it too (restarts that keep the processes): "fail" says
// "failed" and "kept"; "wait" blocks until SIGUSR1, which stands for the abandon signal, then
// says "kept"; "deaf" never answers it. Any other call succeeds and is kept, as kKeptProgram's.
constexpr const char* kSurvivorProgram = R"(
import os, signal, socket, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
os.write(3, b"ready\n")
channel = socket.socket(fileno=3)
def release_output():
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
while True:
    data, fds, _, _ = socket.recv_fds(channel, 65536, 2)
    if not data:
        raise SystemExit(0)
    head, _, body = data.partition(b"\n")
    while len(body) < int(head[5:]):
        body += channel.recv(65536)
    fields = body.split(b"\0")[:-1]
    script = fields[2 + int(fields[1]) - 1]
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.close(fds[0])
    os.close(fds[1])
    os.write(1, b"call in pid %d\n" % os.getpid())
    if script == b"fail":
        os.write(3, b"failed\n")
    elif script == b"wait":
        signal.sigwait({signal.SIGUSR1})
    elif script == b"deaf":
        time.sleep(3600)
    else:
        os.write(3, b"done\n")
    release_output()
    os.write(3, b"kept\n")
)";

class SpareRankTest : public testing::SupervisorFixture {
 protected:
  static Result<SpareRank> StartSpare() {
    SpawnOptions spawn;
    spawn.argv = {"python3", "-c", kSpareProgram, testing::kTakeCallProgram};
    spawn.env = MinimalEnv();
    return SpareRank::Start(testing::KeeperPath(), spawn);
  }

  static std::vector<SpareRank> StartKept(int count, const char* program = kKeptProgram) {
    std::vector<SpareRank> spares;
    for (int i = 0; i < count; ++i) {
      SpawnOptions spawn;
      spawn.argv = {"python3", "-c", program};
      spawn.env = MinimalEnv();
      auto spare = SpareRank::Start(testing::KeeperPath(), spawn);
      EXPECT_TRUE(spare.ok()) << spare.status().message();
      if (spare.ok()) spares.push_back(std::move(spare).ValueOrDie());
    }
    if (program == kSurvivorProgram) {  // it blocks the abandon signal first: until then, the signal would kill it
      for (SpareRank& spare : spares) {
        auto ready = spare.WaitReady(10);
        EXPECT_TRUE(ready.ok() && *ready);
      }
    }
    return spares;
  }

  // A "deaf" rank 0 beside a failing rank 1, under `options`: rank 0 is stopped by SIGTERM, and
  // neither rank survives.
  static void ExpectTheDeafRankStoppedAndNoneSurvives(SupervisorOptions options, std::vector<SpareRank> spares) {
    ASSERT_EQ(spares.size(), 2u);
    auto supervisor = Supervisor::Start(std::move(options), std::move(spares));
    ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
    RunToEnd(**supervisor);
    EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGTERM);
    auto survivors = (*supervisor)->ReleaseSurvivors();
    ASSERT_TRUE(survivors.ok()) << survivors.status().message();
    EXPECT_FALSE((*survivors)[0] || (*survivors)[1]);
  }
};

TEST_F(SpareRankTest, BecomesTheRankItIsHandedWithItsOutputDirectoryAndEnvironment) {
  auto spare = StartSpare();
  ASSERT_TRUE(spare.ok()) << spare.status().message();
  const pid_t spare_pid = spare->pid();
  EXPECT_TRUE(spare->waiting());
  std::vector<SpareRank> spares;
  spares.push_back(std::move(spare).ValueOrDie());
  const std::string script = "echo out$RANK in $(pwd); echo err$RANK >&2";
  auto options = Options({script, script});
  for (auto& rank : options.ranks) rank.spawn.cwd = dir_;
  auto supervisor = Supervisor::Start(options, std::move(spares));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  const auto events = RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->pid(0), spare_pid);
  EXPECT_NE((*supervisor)->pid(1), spare_pid);
  std::map<std::pair<int, Stream>, std::string> lines;
  for (const auto& e : events) {
    if (e.kind == EventKind::kOutput) lines[{e.rank, e.stream}] += e.text;
  }
  for (int rank : {0, 1}) {
    EXPECT_EQ(lines[std::make_pair(rank, Stream::kStdout)], "out" + std::to_string(rank) + " in " + dir_);
    EXPECT_EQ(lines[std::make_pair(rank, Stream::kStderr)], "err" + std::to_string(rank));
    EXPECT_TRUE((*supervisor)->exit_status(rank)->success());
  }
  EXPECT_NE(ReadFile(dir_ + "/rank_0.log").find("out0 in "), std::string::npos);
}

TEST_F(SpareRankTest, SaysWhenItsImportsAreDone) {
  auto spare = StartSpare();
  ASSERT_TRUE(spare.ok()) << spare.status().message();
  auto early = spare->WaitReady(0.01);
  ASSERT_TRUE(early.ok());
  EXPECT_FALSE(*early);
  auto ready = spare->WaitReady(10);
  ASSERT_TRUE(ready.ok());
  EXPECT_TRUE(*ready);
  auto still = spare->WaitReady(0);
  ASSERT_TRUE(still.ok());
  EXPECT_TRUE(*still);
}

TEST_F(SpareRankTest, ItsControlChannelReportsAFailureAndItIsStoppedLikeAnyRank) {
  auto spare = StartSpare();
  ASSERT_TRUE(spare.ok()) << spare.status().message();
  std::vector<SpareRank> spares;
  spares.push_back(std::move(spare).ValueOrDie());
  auto supervisor = Supervisor::Start(Options({"exec sleep 100", "echo failed >&3; exec sleep 100"}), std::move(spares));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
  EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGTERM);  // the spare, stopped through its keeper
}

TEST_F(SpareRankTest, ASpareThatHasEndedCannotBeHandedItsCall) {
  auto spare = StartSpare();
  ASSERT_TRUE(spare.ok()) << spare.status().message();
  const pid_t pid = spare->pid();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_TRUE(ProcessGoneWithin(pid, 5000));  // and with it its end of the control channel
  std::vector<SpareRank> spares;
  spares.push_back(std::move(spare).ValueOrDie());
  auto supervisor = Supervisor::Start(Options({"exec sleep 100"}), std::move(spares));
  ASSERT_FALSE(supervisor.ok());
  EXPECT_NE(supervisor.status().message().find("Rank 0 could not start: The spare rank (pid " + std::to_string(pid)),
            std::string::npos)
      << supervisor.status().message();
}

TEST_F(SpareRankTest, ASpareNeverHandedACallEndsWhenDropped) {
  pid_t pid;
  {
    auto spare = StartSpare();
    ASSERT_TRUE(spare.ok()) << spare.status().message();
    pid = spare->pid();
  }
  EXPECT_TRUE(ProcessGoneWithin(pid, 5000));
}

TEST_F(SpareRankTest, KeptRanksEndTheirCallAliveAndTakeTheNextOne) {
  std::vector<SpareRank> spares = StartKept(2);
  ASSERT_EQ(spares.size(), 2u);
  const pid_t pids[2] = {spares[0].pid(), spares[1].pid()};
  for (int call = 0; call < 3; ++call) {
    auto supervisor = Supervisor::Start(Options({"first", "second"}), std::move(spares));
    ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
    const auto events = RunToEnd(**supervisor);
    const auto out = Lines(events, Stream::kStdout);
    for (int rank : {0, 1}) {
      EXPECT_EQ(out.at(rank), "call in pid " + std::to_string(pids[rank]) + "|") << "call " << call;
      EXPECT_TRUE((*supervisor)->exit_status(rank)->success());
    }
    auto kept = (*supervisor)->ReleaseKept();
    ASSERT_TRUE(kept.ok()) << kept.status().message();
    ASSERT_EQ(kept->size(), 2u);
    for (int rank : {0, 1}) {
      EXPECT_EQ((*kept)[static_cast<size_t>(rank)].pid(), pids[rank]);
      EXPECT_TRUE((*kept)[static_cast<size_t>(rank)].waiting());
    }
    spares = std::move(kept).ValueOrDie();
  }
  spares.clear();  // their keepers end them
  EXPECT_TRUE(ProcessGoneWithin(pids[0], 5000));
  EXPECT_TRUE(ProcessGoneWithin(pids[1], 5000));
}

TEST_F(SpareRankTest, AFailedCallEndsTheRanksItKept) {
  std::vector<SpareRank> spares = StartKept(2);
  ASSERT_EQ(spares.size(), 2u);
  const pid_t kept_pid = spares[0].pid();
  auto supervisor = Supervisor::Start(Options({"first", "fail"}), std::move(spares));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
  auto kept = (*supervisor)->ReleaseKept();
  ASSERT_TRUE(kept.ok()) << kept.status().message();
  EXPECT_TRUE(kept->empty());
  (*supervisor)->KillAndReap();
  EXPECT_TRUE(ProcessGoneWithin(kept_pid, 5000));
}

TEST_F(SpareRankTest, ARankStartedColdCannotBeKept) {
  auto supervisor = Supervisor::Start(Options({"echo done >&3; echo kept >&3; echo after"}));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  const auto events = RunToEnd(**supervisor);
  EXPECT_EQ(Lines(events, Stream::kStdout).at(0), "after|");  // its output to its exit, not cut at "kept"
  auto kept = (*supervisor)->ReleaseKept();
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(kept->empty());
}

TEST_F(SpareRankTest, AfterAFailureTheOtherRanksAbandonTheCallAndSurviveForTheNextAttempt) {
  std::vector<SpareRank> spares = StartKept(3, kSurvivorProgram);
  ASSERT_EQ(spares.size(), 3u);
  const pid_t pids[3] = {spares[0].pid(), spares[1].pid(), spares[2].pid()};
  auto options = Options({"wait", "fail", "wait"});
  options.abandon_signal = SIGUSR1;
  auto supervisor = Supervisor::Start(options, std::move(spares));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kRankFailed);
  auto survivors = (*supervisor)->ReleaseSurvivors();
  ASSERT_TRUE(survivors.ok()) << survivors.status().message();
  ASSERT_EQ(survivors->size(), 3u);
  ASSERT_TRUE((*survivors)[0] && (*survivors)[2]);
  EXPECT_FALSE((*survivors)[1]);  // the rank whose failure started it is not taken again
  EXPECT_EQ((*survivors)[0]->pid(), pids[0]);
  EXPECT_EQ((*survivors)[2]->pid(), pids[2]);
  (*supervisor)->KillAndReap();
  EXPECT_TRUE(ProcessGoneWithin(pids[1], 5000));

  // The next attempt: the survivors at their ranks, a new spare for the failed one.
  std::vector<SpareRank> next;
  next.push_back(std::move(*(*survivors)[0]));
  next.push_back(std::move(StartKept(1, kSurvivorProgram).at(0)));
  next.push_back(std::move(*(*survivors)[2]));
  auto again = Supervisor::Start(Options({"first", "second", "third"}), std::move(next));
  ASSERT_TRUE(again.ok()) << again.status().message();
  const auto out = Lines(RunToEnd(**again), Stream::kStdout);
  EXPECT_EQ(out.at(0), "call in pid " + std::to_string(pids[0]) + "|");
  EXPECT_EQ(out.at(2), "call in pid " + std::to_string(pids[2]) + "|");
  for (int rank : {0, 1, 2}) EXPECT_TRUE((*again)->exit_status(rank)->success());
  EXPECT_EQ((*again)->stop_reason(), StopReason::kNone);
}

TEST_F(SpareRankTest, ARankThatDoesNotAbandonItsCallInTimeIsStopped) {
  auto options = Options({"deaf", "fail"});
  options.abandon_signal = SIGUSR1;
  options.kill_grace_s = 0.3;
  ExpectTheDeafRankStoppedAndNoneSurvives(std::move(options), StartKept(2, kSurvivorProgram));
}

TEST_F(SpareRankTest, WithoutAnAbandonSignalAFailureStopsEveryRankAndNoneSurvives) {
  ExpectTheDeafRankStoppedAndNoneSurvives(Options({"deaf", "fail"}), StartKept(2, kSurvivorProgram));
}

TEST_F(SpareRankTest, AnAbandonSignalThatIsNoSignalIsRefused) {
  auto options = Options({"true"});
  options.abandon_signal = -1;
  auto supervisor = Supervisor::Start(options);
  ASSERT_FALSE(supervisor.ok());
  EXPECT_NE(supervisor.status().message().find("abandon_signal"), std::string::npos);
}

TEST_F(SpareRankTest, MoreSparesThanRanksAreRefused) {
  std::vector<SpareRank> spares;
  for (int i = 0; i < 2; ++i) {
    auto spare = StartSpare();
    ASSERT_TRUE(spare.ok()) << spare.status().message();
    spares.push_back(std::move(spare).ValueOrDie());
  }
  auto supervisor = Supervisor::Start(Options({"true"}), std::move(spares));
  ASSERT_FALSE(supervisor.ok());
  EXPECT_EQ(supervisor.status().message(), "More spare ranks than ranks");
}

}  // namespace
}  // namespace fanrun
