// The supervisor of one run: spawns every rank, multiplexes their output, detects the
// first failure, enforces the timeout and escalates SIGTERM to SIGKILL. It waits on
// pipes and pidfds only; the caller pumps it with Wait() and gets batches of events.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fanrun/fd.h"
#include "fanrun/kept_process.h"
#include "fanrun/line_splitter.h"
#include "fanrun/process.h"
#include "fanrun/run_contract.h"
#include "fanrun/spare_rank.h"
#include "fanrun/status.h"

namespace fanrun {

struct RankOptions {
  // argv, env and cwd of the rank; the supervisor sets its descriptors.
  SpawnOptions spawn;
  // Everything the rank writes to stdout and stderr, byte for byte.
  std::string log_path;
};

struct SupervisorOptions {
  std::vector<RankOptions> ranks;
  // The fanrun-keeper executable: each rank runs under a keeper of its own, which ends every
  // process the rank started, in any group or session, when the rank ends or the caller dies.
  std::string keeper_path;
  double timeout_s = 0;            // <= 0: no timeout
  double kill_grace_s = 5;         // from SIGTERM to SIGKILL
  int stack_dump_signal = 0;       // sent to every rank at the timeout, before the kill; 0: none
  double stack_dump_wait_s = 1;    // how long the ranks get to write their stacks
  int wakeup_fd = -1;              // Wait() returns "interrupted" when this becomes readable
  size_t max_line_bytes = 64 * 1024;
  // Output held for the rest of its line (a prompt, "waiting...") is shown once it has been
  // held this long.
  double show_held_after_s = 0.15;
  // Give each rank a pipe at kControlFd on which it reports kControlFailed the moment it has
  // written its error, before its (possibly slow) interpreter shutdown, and kControlDone once
  // it has written its result; kControlLog carries text for its log alone (run_contract.h).
  bool control_channel = true;
  // A rank that exits with code 0 without having reported "done" has failed: it ended
  // without returning (os._exit(0) in a function), and its siblings are stopped at once.
  bool expect_done = false;
  // Restarts that keep the processes: when a rank fails, each other rank that was a spare is sent
  // this signal instead of SIGTERM. It abandons its call (its process group aborted, not waited
  // on) and says kControlKept; ReleaseSurvivors() then hands it to the next attempt. A rank that
  // has not said so within kill_grace_s is stopped as usual. 0: every rank is stopped.
  int abandon_signal = 0;
  // After the first failure, the ranks still running are left as they are for at most this
  // long, so that the caller can ask them what they were doing (a peer waiting in a collective
  // for the failed rank) before they are stopped; EndFailureEvidence() ends it sooner. 0: they
  // are stopped at once.
  double failure_evidence_s = 0;
};

struct Event {
  EventKind kind;
  int rank;                                  // -1 for kTimedOut, which is the run's
  Stream stream = Stream::kStdout;           // kOutput
  SegmentKind segment = SegmentKind::kLine;  // kOutput
  std::string text;                          // kOutput
  ExitStatus exit;                           // kRankExited
};

struct WaitResult {
  std::vector<Event> events;
  bool interrupted = false;  // a signal or the wakeup fd woke the wait
  bool done = false;         // every rank has exited and been reaped
};

class Supervisor {
 public:
  // Spawns every rank; rank i < spares.size() is spares[i], handed its call instead (each
  // RankOptions' spawn but its executable). When one cannot start, those already started are killed.
  static Result<std::unique_ptr<Supervisor>> Start(SupervisorOptions options, std::vector<SpareRank> spares = {});
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;
  // Ranks still running are killed, with every process they started, and reaped.
  ~Supervisor();

  // Blocks until there is something to report, a deadline passes, or a signal or the
  // wakeup fd interrupts it; or, when max_wait_s >= 0, until that much time has passed
  // (to redraw a display). Output is gathered for gather_s after its first piece arrives and
  // reported in one batch (a display that redraws once a second needs no more wake-ups than
  // that); any other event is reported at once. Not thread-safe: one thread pumps a supervisor.
  Result<WaitResult> Wait(double max_wait_s = -1, double gather_s = 0);
  // Stops every rank: SIGTERM now, SIGKILL after the grace period. Idempotent.
  void Cancel();
  // Whether the first failure has come and the ranks still running are left as they are, for
  // the caller to ask them what they were doing (failure_evidence_s).
  bool gathering_failure_evidence() const { return evidence_until_.has_value(); }
  // Stops the ranks after the first failure now, as failure_evidence_s would once it is over.
  void EndFailureEvidence();
  // Kills every rank still running, and every kept rank not released, with every process it
  // started, and reaps it, at once.
  void KillAndReap();
  // Once every rank has said kControlKept (each was a spare) and the run did not stop early:
  // the ranks, in rank order, as spares waiting for their next call. Otherwise none: the kept
  // ranks end with the supervisor.
  Result<std::vector<SpareRank>> ReleaseKept();
  // Once a rank failed and the run abandoned its call (abandon_signal): in rank order, each rank
  // that said kControlKept, as a spare for the next attempt, and none for the rank whose failure
  // started it or a rank that ended. The rest end with the supervisor.
  Result<std::vector<std::optional<SpareRank>>> ReleaseSurvivors();

  int world_size() const { return static_cast<int>(ranks_.size()); }
  pid_t pid(int rank) const { return ranks_[static_cast<size_t>(rank)].pid; }
  std::optional<ExitStatus> exit_status(int rank) const { return ranks_[static_cast<size_t>(rank)].exit; }
  const std::string& log_path(int rank) const { return ranks_[static_cast<size_t>(rank)].log_path; }
  // The root cause: the first rank that reported a failure, ended badly, or (with
  // expect_done) exited without reporting "done"; or a rank killed by a signal that the
  // supervisor did not send, dead by then or within two seconds after; -1 if none.
  int first_failed_rank() const { return first_failed_rank_; }
  StopReason stop_reason() const { return stop_reason_; }
  // The ranks still running when the timeout struck.
  const std::vector<int>& ranks_running_at_timeout() const { return running_at_timeout_; }

 private:
  using Clock = std::chrono::steady_clock;

  // The read end of a rank's stdout or stderr pipe, and its line so far.
  struct OutputPipe {
    Stream stream;
    FileDescriptor fd;
    LineSplitter lines;
    std::optional<Clock::time_point> show_held_at;  // when what `lines` holds is shown
    OutputPipe(Stream which, size_t max_line) : stream(which), lines(max_line) {}
  };

  struct Rank {
    std::optional<KeptProcess> process;
    pid_t pid = -1;
    std::string log_path;
    FileDescriptor log;
    std::unique_ptr<OutputPipe> out, err;
    FileDescriptor control;
    std::string control_buffer;
    bool control_line_dropped = false;  // the control line read now was too long: skipped to its end
    bool done = false;
    bool spare = false;  // its control channel is a socket, on which it can take another call
    bool kept = false;   // it said kControlKept: its call is over, it waits for the next one
    std::optional<ExitStatus> exit;  // kept: a success, though it runs on
  };

  explicit Supervisor(SupervisorOptions options);
  Status SpawnRank(size_t index, std::optional<SpareRank> spare);

  // Reads once from a ready output pipe; on end of stream finishes and closes it.
  void PumpStream(size_t rank, OutputPipe& pipe, std::vector<Event>& events);
  // Reads what the pipe holds now, without waiting.
  void PumpAvailable(size_t rank, OutputPipe& pipe, std::vector<Event>& events);
  void DrainStream(size_t rank, OutputPipe& pipe, std::vector<Event>& events);
  void PumpControl(size_t rank, std::vector<Event>& events);
  void OnExit(size_t rank, std::vector<Event>& events);
  void OnKept(size_t rank, std::vector<Event>& events);
  void OnFailure(size_t rank);
  void StopAfterFailure(Clock::time_point now);
  bool KilledFromOutsideJustAfterTheFirstFailure(const ExitStatus& exit) const;
  void HandleDeadlines(Clock::time_point now, std::vector<Event>& events);
  void ShowHeldOutput(Clock::time_point now, std::vector<Event>& events);
  void Terminate(Clock::time_point now);
  void Abandon(Clock::time_point now);
  void SignalRunning(int signo, bool with_descendants);
  bool AllReaped() const;
  int MillisecondsToNextDeadline(Clock::time_point now, std::optional<Clock::time_point> return_at) const;

  SupervisorOptions options_;
  std::vector<Rank> ranks_;
  int first_failed_rank_ = -1;
  StopReason stop_reason_ = StopReason::kNone;
  std::vector<int> running_at_timeout_;
  std::optional<Clock::time_point> timeout_at_, dump_done_at_, kill_at_, first_failure_at_;
  bool terminating_ = false;
  bool abandoning_ = false;  // the call is being abandoned: the ranks may say kControlKept without "done"
  std::optional<Clock::time_point> abandon_until_;  // then the ranks not kept yet are stopped
  std::optional<Clock::time_point> evidence_until_;  // then the ranks are stopped after the first failure
  std::optional<Clock::time_point> sigkill_sent_at_;
};

}  // namespace fanrun
