// Tests of supervising a run: output, failures, escalation, timeouts, interrupts.
#include "fanrun/supervisor.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "supervisor/supervisor_test_fixture_internal.h"

namespace fanrun {
namespace {

using testing::MinimalEnv;
using testing::ProcessGoneWithin;
using testing::ShellCommand;

using SupervisorTest = testing::SupervisorFixture;

// Pumps until the first failure has come: the caller's turn to ask the others.
void WaitForTheFirstFailure(Supervisor& supervisor) {
  while (supervisor.stop_reason() == StopReason::kNone) ASSERT_TRUE(supervisor.Wait().ok());
}

// Rank 0 fails at 0.2 s; rank 1, deaf to SIGTERM, is killed from outside (SIGKILL) at `seconds`.
std::vector<std::string> FailureThenAKillFromOutsideAt(const std::string& seconds) {
  return {"sleep 0.2; exit 1", "trap '' TERM; sleep " + seconds + "; kill -KILL $$; sleep 100"};
}

// Rank 0 fails at 0.2 s while rank 1 sleeps on: a peer to ask for evidence.
std::vector<std::string> FailureBesideASleeper() { return {"sleep 0.2; exit 1", "exec sleep 100"}; }

TEST_F(SupervisorTest, EveryRankRunsAndItsOutputArrivesLabelledAndLogged) {
  auto supervisor = Supervisor::Start(Options({"echo out$RANK; echo err$RANK >&2", "echo out$RANK; echo err$RANK >&2"}));
  ASSERT_TRUE(supervisor.ok()) << supervisor.status().message();
  auto events = RunToEnd(**supervisor);
  EXPECT_EQ(Lines(events, Stream::kStdout), (std::map<int, std::string>{{0, "out0|"}, {1, "out1|"}}));
  EXPECT_EQ(Lines(events, Stream::kStderr), (std::map<int, std::string>{{0, "err0|"}, {1, "err1|"}}));
  EXPECT_EQ((*supervisor)->first_failed_rank(), -1);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kNone);
  EXPECT_TRUE((*supervisor)->exit_status(0)->success());
  const std::string log = ReadFile(dir_ + "/rank_1.log");
  EXPECT_NE(log.find("out1\n"), std::string::npos);
  EXPECT_NE(log.find("err1\n"), std::string::npos);
}

TEST_F(SupervisorTest, FirstFailureIsTheRootCauseAndTheOthersAreTerminated) {
  auto supervisor = Supervisor::Start(Options({"exec sleep 100", "sleep 0.2; exit 7", "exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  const auto start = std::chrono::steady_clock::now();
  auto events = RunToEnd(**supervisor);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kRankFailed);
  EXPECT_EQ((*supervisor)->exit_status(1)->exit_code, 7);
  EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGTERM);
  EXPECT_EQ((*supervisor)->exit_status(2)->term_signal, SIGTERM);
}

TEST_F(SupervisorTest, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  auto options = Options({"trap '' TERM; echo ready; while :; do sleep 1; done", "sleep 0.3; exit 1"});
  options.kill_grace_s = 0.3;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGKILL);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);  // the supervisor's own SIGKILL names no new cause
}

TEST_F(SupervisorTest, ARankKilledFromOutsideJustAfterAPeersFailureIsTheRootCause) {
  // Rank 0 stands for a peer whose collective failed because rank 1 died: its report can come
  // first, since rank 1's death reaches the supervisor through its keeper.
  auto options = Options(FailureThenAKillFromOutsideAt("0.4"));
  options.kill_grace_s = 3;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->exit_status(1)->term_signal, SIGKILL);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
}

TEST_F(SupervisorTest, ARankKilledFromOutsideWhoseDeathIsReadLateIsStillTheRootCause) {
  // The supervisor reads rank 1's death only after its grace period is over and it has sent its
  // own SIGKILL (a caller slow to pump, a keeper slow to report): the death came before that
  // SIGKILL, so it is not the supervisor's, and it came just after rank 0's failure.
  auto options = Options(FailureThenAKillFromOutsideAt("0.4"));
  options.kill_grace_s = 0.5;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  WaitForTheFirstFailure(**supervisor);
  ASSERT_EQ((*supervisor)->first_failed_rank(), 0);
  ::usleep(1500 * 1000);  // rank 1 dies meanwhile, and its report waits
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->exit_status(1)->term_signal, SIGKILL);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
}

TEST_F(SupervisorTest, ARankKilledFromOutsideLongAfterTheFirstFailureIsNotTheRootCause) {
  auto options = Options(FailureThenAKillFromOutsideAt("2.7"));
  options.kill_grace_s = 4;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->exit_status(1)->term_signal, SIGKILL);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 0);
}

TEST_F(SupervisorTest, AfterTheFirstFailureTheOthersAreLeftRunningUntilTheEvidenceIsIn) {
  auto options = Options(FailureBesideASleeper());
  options.failure_evidence_s = 30;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  WaitForTheFirstFailure(**supervisor);
  EXPECT_TRUE((*supervisor)->gathering_failure_evidence());
  // Nothing stops rank 1 meanwhile: a wait reports nothing of it.
  auto quiet = (*supervisor)->Wait(0.5);
  ASSERT_TRUE(quiet.ok());
  for (const Event& event : quiet->events) EXPECT_NE(event.rank, 1);
  EXPECT_FALSE((*supervisor)->exit_status(1).has_value());
  const auto ended_at = std::chrono::steady_clock::now();
  (*supervisor)->EndFailureEvidence();
  EXPECT_FALSE((*supervisor)->gathering_failure_evidence());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->exit_status(1)->term_signal, SIGTERM);
  EXPECT_LT(std::chrono::steady_clock::now() - ended_at, std::chrono::seconds(2));  // at once, not after 30 s
  EXPECT_EQ((*supervisor)->first_failed_rank(), 0);
}

TEST_F(SupervisorTest, TheOthersAreStoppedWhenTheEvidenceTimeIsOverWhateverTheCallerDoes) {
  auto options = Options(FailureBesideASleeper());
  options.failure_evidence_s = 0.4;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  WaitForTheFirstFailure(**supervisor);
  const auto failed_at = std::chrono::steady_clock::now();
  RunToEnd(**supervisor);
  const auto took = std::chrono::steady_clock::now() - failed_at;
  EXPECT_EQ((*supervisor)->exit_status(1)->term_signal, SIGTERM);
  EXPECT_GE(took, std::chrono::milliseconds(350));
  EXPECT_LT(took, std::chrono::seconds(3));
}

TEST_F(SupervisorTest, WithNoOtherRankRunningThereIsNoEvidenceToWaitFor) {
  auto options = Options({"sleep 0.2; exit 1", "exit 0"});
  options.failure_evidence_s = 30;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);  // would take 30 s if it waited
  EXPECT_FALSE((*supervisor)->gathering_failure_evidence());
  EXPECT_EQ((*supervisor)->first_failed_rank(), 0);
}

TEST_F(SupervisorTest, CancelDuringTheEvidenceTimeStopsEveryRank) {
  auto options = Options(FailureBesideASleeper());
  options.failure_evidence_s = 30;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  WaitForTheFirstFailure(**supervisor);
  (*supervisor)->Cancel();
  EXPECT_FALSE((*supervisor)->gathering_failure_evidence());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->exit_status(1)->term_signal, SIGTERM);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kRankFailed);
}

TEST_F(SupervisorTest, ControlChannelReportsAFailureBeforeTheRankExits) {
  auto supervisor = Supervisor::Start(Options({"echo failed >&3; exec sleep 100", "exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  auto events = RunToEnd(**supervisor);
  ASSERT_FALSE(events.empty());
  bool failed_reported = false;
  for (const auto& e : events) failed_reported |= e.kind == EventKind::kRankFailed && e.rank == 0;
  EXPECT_TRUE(failed_reported);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 0);
  // It was still running when reported, so it was terminated too.
  EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGTERM);
}

TEST_F(SupervisorTest, TextSentForTheLogAloneIsLoggedInOrderAndNotShown) {
  // The traceback arrives on the control channel in two writes; what the rank printed
  // before it is still in its pipe when the control message is read.
  auto supervisor = Supervisor::Start(
      Options({"echo before >&2; printf 'log 25\\nTraceback:\\n' >&3; sleep 0.2; printf '  line 1\\nboom\\nfailed\\n' >&3; "
               "exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  auto events = RunToEnd(**supervisor);
  EXPECT_EQ(Lines(events, Stream::kStderr), (std::map<int, std::string>{{0, "before|"}}));
  EXPECT_EQ((*supervisor)->first_failed_rank(), 0);
  EXPECT_EQ(ReadFile(dir_ + "/rank_0.log"), "before\nTraceback:\n  line 1\nboom\n");
}

TEST_F(SupervisorTest, ALogMessageThatIsNotOneIsDropped) {
  auto supervisor = Supervisor::Start(Options({"printf 'log 99999999999\\nlog x\\nfailed\\n' >&3; exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 0);  // the lines after it are read as ever
  EXPECT_EQ(ReadFile(dir_ + "/rank_0.log"), "");
}

TEST_F(SupervisorTest, ALongControlLineIsDroppedAsItComesAndTheNextMessageRead) {
  // 16 MB without a newline, read 256 bytes at a time: searched whole at each read, it took minutes.
  auto supervisor = Supervisor::Start(Options(
      {"head -c 16000000 /dev/zero | tr '\\0' x >&3; printf 'tail\\nfailed\\n' >&3; exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  const auto start = std::chrono::steady_clock::now();
  RunToEnd(**supervisor);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ((*supervisor)->first_failed_rank(), 0);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kRankFailed);
}

TEST_F(SupervisorTest, TimeoutDumpsStacksThenKills) {
  auto options = Options({"trap 'echo dumping >&2' USR1; echo up; while :; do sleep 0.05; done",
                          "trap 'echo dumping >&2' USR1; while :; do sleep 0.05; done"});
  options.timeout_s = 0.5;
  options.stack_dump_signal = SIGUSR1;
  options.stack_dump_wait_s = 0.3;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  auto events = RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kTimeout);
  EXPECT_EQ((*supervisor)->ranks_running_at_timeout(), (std::vector<int>{0, 1}));
  EXPECT_EQ(Lines(events, Stream::kStderr), (std::map<int, std::string>{{0, "dumping|"}, {1, "dumping|"}}));
  EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGTERM);
  // The timeout is an event of its own, before any rank was stopped.
  const auto timed_out = std::find_if(events.begin(), events.end(), [](const Event& e) { return e.kind == EventKind::kTimedOut; });
  ASSERT_NE(timed_out, events.end());
  EXPECT_TRUE(std::none_of(events.begin(), timed_out, [](const Event& e) { return e.kind == EventKind::kRankExited; }));
}

TEST_F(SupervisorTest, CancelStopsEveryRank) {
  auto supervisor = Supervisor::Start(Options({"exec sleep 100", "exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  (*supervisor)->Cancel();
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kCancelled);
  EXPECT_EQ((*supervisor)->first_failed_rank(), -1);
}

TEST_F(SupervisorTest, WakeupDescriptorInterruptsTheWait) {
  auto wakeup = MakePipe();
  ASSERT_TRUE(wakeup.ok());
  auto options = Options({"exec sleep 100"});
  options.wakeup_fd = wakeup->read.fd();
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  ASSERT_TRUE(WriteAll(wakeup->write.fd(), "x", 1).ok());
  auto batch = (*supervisor)->Wait();
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(batch->interrupted);
  EXPECT_FALSE(batch->done);
}

TEST_F(SupervisorTest, PartialVeryLongAndBinaryOutputArriveWhole) {
  auto options = Options({"printf 'no newline'; head -c 300000 /dev/zero | tr '\\0' a; printf '\\n\\001\\377\\000end\\n'"});
  options.max_line_bytes = 65536;
  options.show_held_after_s = 60;  // cut by length alone, however slowly the pipeline writes
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  auto events = RunToEnd(**supervisor);
  std::string joined;
  size_t partials = 0;
  for (const auto& e : events) {
    if (e.kind != EventKind::kOutput) continue;
    joined += e.text;
    if (e.segment == SegmentKind::kPartial) {
      ++partials;
      EXPECT_EQ(e.text.size(), 65536u);
    } else {
      joined += "\n";
    }
  }
  EXPECT_EQ(partials, 4u);
  // EXPECT_TRUE, not EXPECT_EQ: a failure should not print 300 kB.
  EXPECT_TRUE(joined == "no newline" + std::string(300000, 'a') + "\n" + std::string("\x01\xff\x00" "end\n", 7));
  EXPECT_TRUE(ReadFile(dir_ + "/rank_0.log") == joined);
}

TEST_F(SupervisorTest, LineWithoutNewlineArrivesWhileTheRankWaits) {
  auto options = Options({"echo start; printf 'waiting...'; exec sleep 100"});
  options.timeout_s = 5;  // without the hold's deadline, the text would come only now
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  std::vector<Event> events;
  std::optional<std::chrono::steady_clock::time_point> started;
  while (events.empty() || events.back().segment != SegmentKind::kPartial) {
    auto batch = (*supervisor)->Wait();
    ASSERT_TRUE(batch.ok());
    ASSERT_FALSE(batch->done);
    for (auto& e : batch->events) {
      if (e.kind != EventKind::kOutput) continue;
      if (!started) started = std::chrono::steady_clock::now();
      events.push_back(std::move(e));
    }
  }
  const auto held_for = std::chrono::steady_clock::now() - *started;
  EXPECT_LT(held_for, std::chrono::milliseconds(1000));
  EXPECT_GE(held_for, std::chrono::milliseconds(100));
  EXPECT_EQ(Lines(events, Stream::kStdout), (std::map<int, std::string>{{0, "start|waiting...|"}}));
  (*supervisor)->Cancel();
  RunToEnd(**supervisor);
  EXPECT_EQ(ReadFile(dir_ + "/rank_0.log"), "start\nwaiting...");
}

TEST_F(SupervisorTest, WaitWithALimitReturnsByThenWithNothingToReport) {
  auto supervisor = Supervisor::Start(Options({"exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  const auto start = std::chrono::steady_clock::now();
  auto batch = (*supervisor)->Wait(0.2);
  const auto waited = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(batch->events.empty());
  EXPECT_FALSE(batch->done);
  EXPECT_FALSE(batch->interrupted);
  EXPECT_GE(waited, std::chrono::milliseconds(200));
  EXPECT_LT(waited, std::chrono::milliseconds(2000));
}

TEST_F(SupervisorTest, OutputGatheredIsReportedInOneBatchAndAnExitAtOnce) {
  // Five lines 50 ms apart: gathered for 2 s, they come in one batch with the exit that ends
  // them, long before the 2 s are up.
  auto supervisor = Supervisor::Start(Options({"for i in 1 2 3 4 5; do echo $i; sleep 0.05; done"}));
  ASSERT_TRUE(supervisor.ok());
  const auto start = std::chrono::steady_clock::now();
  auto batch = (*supervisor)->Wait(-1, 2.0);
  ASSERT_TRUE(batch.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500));
  EXPECT_EQ(Lines(batch->events, Stream::kStdout), (std::map<int, std::string>{{0, "1|2|3|4|5|"}}));
  ASSERT_FALSE(batch->events.empty());
  EXPECT_EQ(batch->events.back().kind, EventKind::kRankExited);
  RunToEnd(**supervisor);
}

TEST_F(SupervisorTest, OutputGatheredIsReportedOnceTheGatheringTimeIsUp) {
  auto supervisor = Supervisor::Start(Options({"echo first; sleep 0.1; echo second; exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  const auto start = std::chrono::steady_clock::now();
  auto batch = (*supervisor)->Wait(-1, 0.4);
  const auto waited = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(Lines(batch->events, Stream::kStdout), (std::map<int, std::string>{{0, "first|second|"}}));
  EXPECT_GE(waited, std::chrono::milliseconds(400));
  EXPECT_LT(waited, std::chrono::milliseconds(2000));
  (*supervisor)->Cancel();
  RunToEnd(**supervisor);
}

TEST_F(SupervisorTest, OutputGatheredPastAMegabyteIsReportedAtOnce) {
  auto supervisor = Supervisor::Start(Options({"head -c 4000000 /dev/zero | tr '\\0' 'x'; exec sleep 100"}));
  ASSERT_TRUE(supervisor.ok());
  const auto start = std::chrono::steady_clock::now();
  auto batch = (*supervisor)->Wait(-1, 30.0);
  ASSERT_TRUE(batch.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  size_t bytes = 0;
  for (const auto& e : batch->events) bytes += e.text.size();
  EXPECT_GE(bytes, size_t{1} << 20);
  EXPECT_LT(bytes, size_t{4000000});
  (*supervisor)->Cancel();
  RunToEnd(**supervisor);
}

TEST_F(SupervisorTest, WhatARankLeavesBehindIsGoneWhenItsExitIsReported) {
  // A plain child, one in a new session, and one orphaned at once.
  auto supervisor = Supervisor::Start(Options({"sleep 100 & echo $!; setsid sleep 100 & echo $!; (setsid sleep 100 & echo $!)"}));
  ASSERT_TRUE(supervisor.ok());
  auto events = RunToEnd(**supervisor);
  std::vector<pid_t> leftovers;
  for (const auto& e : events) {
    if (e.kind == EventKind::kOutput && e.stream == Stream::kStdout) leftovers.push_back(static_cast<pid_t>(std::stoi(e.text)));
  }
  ASSERT_EQ(leftovers.size(), 3u);
  for (pid_t pid : leftovers) EXPECT_TRUE(ProcessGoneWithin(pid, 0)) << pid;
  EXPECT_TRUE((*supervisor)->exit_status(0)->success());
}

TEST_F(SupervisorTest, ARankThatExitsWithoutReportingDoneFailsAtOnceWhenDoneIsExpected) {
  auto options = Options({"exec sleep 100", "exit 0"});
  options.expect_done = true;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  const auto start = std::chrono::steady_clock::now();
  RunToEnd(**supervisor);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kRankFailed);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
  EXPECT_EQ((*supervisor)->exit_status(1)->exit_code, 0);
  EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGTERM);
}

TEST_F(SupervisorTest, ARankThatReportedDoneAndExits0Succeeds) {
  auto options = Options({"echo done >&3", "echo done >&3; sleep 0.2"});
  options.expect_done = true;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kNone);
  EXPECT_EQ((*supervisor)->first_failed_rank(), -1);
}

TEST_F(SupervisorTest, WithoutExpectingDoneAnExit0IsSuccess) {
  auto supervisor = Supervisor::Start(Options({"exit 0", "true"}));
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->stop_reason(), StopReason::kNone);
}

TEST_F(SupervisorTest, StoppingARunReachesWhatItsRanksStartedInOtherSessions) {
  // The rank's own group ignores SIGTERM; what it started in a new session records it.
  auto options = Options({"setsid sh -c 'trap \"echo term >> " + dir_ +
                              "/got; exit 0\" TERM; while :; do sleep 0.05; done' & trap '' TERM; while :; do sleep 0.05; done",
                          "sleep 0.5; exit 1"});
  options.kill_grace_s = 1;
  auto supervisor = Supervisor::Start(options);
  ASSERT_TRUE(supervisor.ok());
  RunToEnd(**supervisor);
  EXPECT_EQ((*supervisor)->first_failed_rank(), 1);
  EXPECT_EQ((*supervisor)->exit_status(0)->term_signal, SIGKILL);
  EXPECT_EQ(ReadFile(dir_ + "/got"), "term\n");
}

TEST_F(SupervisorTest, ARankThatCannotStartStopsTheRunAndKillsTheStartedOnes) {
  auto options = Options({"exec sleep 100", "true"});
  options.ranks[1].spawn.argv = {"/nonexistent/fanrun-program"};
  auto supervisor = Supervisor::Start(options);
  ASSERT_FALSE(supervisor.ok());
  EXPECT_NE(supervisor.status().message().find("Rank 1 could not start"), std::string::npos);
  EXPECT_NE(supervisor.status().message().find("/nonexistent/fanrun-program"), std::string::npos);
}

TEST_F(SupervisorTest, InvalidOptionsAreRejected) {
  EXPECT_FALSE(Supervisor::Start(SupervisorOptions{}).ok());
  auto options = Options({"true"});
  options.kill_grace_s = -1;
  EXPECT_EQ(Supervisor::Start(options).status().code(), StatusCode::kInvalid);
  options = Options({"true"});
  options.keeper_path.clear();
  EXPECT_EQ(Supervisor::Start(options).status().code(), StatusCode::kInvalid);
  options = Options({"true"});
  options.show_held_after_s = -1;
  EXPECT_EQ(Supervisor::Start(options).status().code(), StatusCode::kInvalid);
  options = Options({"true"});
  options.failure_evidence_s = -1;
  EXPECT_EQ(Supervisor::Start(options).status().code(), StatusCode::kInvalid);
  options = Options({"true"});
  options.control_channel = false;
  options.expect_done = true;
  EXPECT_EQ(Supervisor::Start(options).status().code(), StatusCode::kInvalid);
}

}  // namespace
}  // namespace fanrun
