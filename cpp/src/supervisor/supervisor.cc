// The supervisor of one run.
#include "fanrun/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string_view>
#include <utility>

namespace fanrun {
namespace {

constexpr size_t kReadChunk = 64 * 1024;
constexpr size_t kLongestLogText = 4 << 20;
// Longer than any of fanrun's control messages ("log 4194304"): a line of the control channel
// that grows past this without a newline is not one, and is dropped as it comes, so that the
// buffer, and the search for its newline, stay this small.
constexpr size_t kLongestControlLine = 64;
// A year bounds every period: beyond it the clock arithmetic would overflow.
constexpr double kLongestPeriodS = 365.0 * 24 * 3600;
// Output gathered past this is reported at once: a rank that floods its stream is not held in
// memory for the whole gathering time.
constexpr size_t kMostGatheredBytes = 1 << 20;
// A rank killed by a signal (SIGKILL from the OOM killer, SIGSEGV) drops its connections, and
// its peers' collectives fail with "connection reset" at once, often before the killed rank's
// keeper has reported the death: on a loaded 2-core machine the report came more than 1 s after
// a peer's, and once after the grace period, when a SIGKILL of ours could be blamed for it. So
// the death is judged by when its keeper saw it, not by when the report came: a death by a
// signal the supervisor had not sent, seen by then or at most this long after the first failure,
// is the root cause instead. (The margin is the keeper's own delay in waking to its SIGCHLD.)
constexpr double kPeerFailureWindowS = 2.0;

// What a descriptor that Wait() polls stands for, besides its rank.
enum class Watched { kExit, kStdout, kStderr, kControl };
struct PollSlot {
  size_t rank;
  Watched what;
};

std::chrono::steady_clock::duration Seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

Supervisor::Supervisor(SupervisorOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<Supervisor>> Supervisor::Start(SupervisorOptions options, std::vector<SpareRank> spares) {
  if (options.ranks.empty()) return Status::Invalid("A run needs at least one rank");
  if (spares.size() > options.ranks.size()) return Status::Invalid("More spare ranks than ranks");
  if (!spares.empty() && !options.control_channel) {
    return Status::Invalid("Spare ranks are handed their calls over the control channel");
  }
  for (double seconds :
       {options.timeout_s, options.kill_grace_s, options.stack_dump_wait_s, options.show_held_after_s,
        options.failure_evidence_s}) {
    if (!std::isfinite(seconds) || seconds > kLongestPeriodS) {
      return Status::Invalid("Timeouts and grace periods must be finite and under a year, not ", seconds);
    }
  }
  if (options.kill_grace_s < 0 || options.stack_dump_wait_s < 0 || options.show_held_after_s < 0 ||
      options.failure_evidence_s < 0) {
    return Status::Invalid("Grace periods cannot be negative");
  }
  if (options.max_line_bytes == 0) return Status::Invalid("max_line_bytes must be positive");
  if (options.keeper_path.empty()) return Status::Invalid("A run needs the path of fanrun-keeper");
  if (options.expect_done && !options.control_channel) {
    return Status::Invalid("expect_done needs the control channel");
  }
  if (options.abandon_signal < 0 || options.abandon_signal >= NSIG) {
    return Status::Invalid("abandon_signal must be 0 or a signal number, not ", options.abandon_signal);
  }
  std::unique_ptr<Supervisor> supervisor(new Supervisor(std::move(options)));
  supervisor->ranks_.resize(supervisor->options_.ranks.size());
  for (size_t i = 0; i < supervisor->ranks_.size(); ++i) {
    std::optional<SpareRank> spare;
    if (i < spares.size()) spare.emplace(std::move(spares[i]));
    Status st = supervisor->SpawnRank(i, std::move(spare));
    // Returning drops the supervisor, whose destructor kills the ranks already started.
    if (!st.ok()) return Status(st.code(), internal::StrCat("Rank ", i, " could not start: ", st.message()));
  }
  if (supervisor->options_.timeout_s > 0) {
    supervisor->timeout_at_ = Clock::now() + Seconds(supervisor->options_.timeout_s);
  }
  return supervisor;
}

Status Supervisor::SpawnRank(size_t index, std::optional<SpareRank> spare) {
  Rank& rank = ranks_[index];
  const RankOptions& launch = options_.ranks[index];
  rank.log_path = launch.log_path;
  FANRUN_ASSIGN_OR_RETURN(rank.log, OpenFile(launch.log_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0600));
  FANRUN_ASSIGN_OR_RETURN(Pipe out, MakePipe());
  FANRUN_ASSIGN_OR_RETURN(Pipe err, MakePipe());
  Pipe control;
  if (spare) {
    FANRUN_ASSIGN_OR_RETURN(auto became, std::move(*spare).Become(launch.spawn, out.write.fd(), err.write.fd()));
    rank.process.emplace(std::move(became.first));
    rank.spare = true;
    control.read = std::move(became.second);  // the spare's socket, read as a cold rank's pipe is
  } else {
    if (options_.control_channel) {
      FANRUN_ASSIGN_OR_RETURN(control, MakePipe());
    }
    SpawnOptions spawn = launch.spawn;
    spawn.stdout_fd = out.write.fd();
    spawn.stderr_fd = err.write.fd();
    spawn.control_fd = control.write.fd();
    FANRUN_ASSIGN_OR_RETURN(KeptProcess child, KeptProcess::Start(options_.keeper_path, spawn));
    rank.process.emplace(std::move(child));
  }
  rank.pid = rank.process->pid();
  // Only the child holds the write ends now, so its exit ends our reads.
  FANRUN_RETURN_NOT_OK(out.write.Close());
  FANRUN_RETURN_NOT_OK(err.write.Close());
  FANRUN_RETURN_NOT_OK(control.write.Close());
  FANRUN_RETURN_NOT_OK(SetNonBlocking(out.read.fd()));
  FANRUN_RETURN_NOT_OK(SetNonBlocking(err.read.fd()));
  rank.out = std::make_unique<OutputPipe>(Stream::kStdout, options_.max_line_bytes);
  rank.out->fd = std::move(out.read);
  rank.err = std::make_unique<OutputPipe>(Stream::kStderr, options_.max_line_bytes);
  rank.err->fd = std::move(err.read);
  if (control.read.valid()) {
    FANRUN_RETURN_NOT_OK(SetNonBlocking(control.read.fd()));
    rank.control = std::move(control.read);
  }
  return Status::OK();
}

Supervisor::~Supervisor() { KillAndReap(); }

void Supervisor::KillAndReap() {
  auto running = [](const Rank& rank) { return rank.process && (!rank.exit || rank.kept); };
  // Every keeper is told first, so that they all clean up at the same time.
  for (auto& rank : ranks_) {
    if (running(rank)) rank.process->KillAll();
  }
  for (auto& rank : ranks_) {
    if (!running(rank)) continue;
    auto status = rank.process->Wait();
    if (status.ok() && !rank.kept) rank.exit = *status;  // a kept rank's call had ended well
    FANRUN_WARN_NOT_OK(status.status(), "reaping a rank");
    if (rank.kept) rank.process.reset();
  }
}

Result<std::vector<std::optional<SpareRank>>> Supervisor::ReleaseSurvivors() {
  std::vector<std::optional<SpareRank>> survivors(ranks_.size());
  if (!abandoning_) return survivors;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    Rank& rank = ranks_[i];
    if (static_cast<int>(i) == first_failed_rank_ || !rank.kept || !rank.process) continue;
    FANRUN_ASSIGN_OR_RETURN(SpareRank spare, SpareRank::Kept(std::move(*rank.process), std::move(rank.control)));
    rank.process.reset();
    survivors[i].emplace(std::move(spare));
  }
  return survivors;
}

Result<std::vector<SpareRank>> Supervisor::ReleaseKept() {
  std::vector<SpareRank> spares;
  const bool all_kept =
      std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.kept && r.process; });
  if (stop_reason_ != StopReason::kNone || !all_kept) return spares;
  for (auto& rank : ranks_) {
    FANRUN_ASSIGN_OR_RETURN(SpareRank spare, SpareRank::Kept(std::move(*rank.process), std::move(rank.control)));
    rank.process.reset();
    spares.push_back(std::move(spare));
  }
  return spares;
}

void Supervisor::PumpStream(size_t rank, OutputPipe& pipe, std::vector<Event>& events) {
  char buffer[kReadChunk];
  const ssize_t n = ::read(pipe.fd.fd(), buffer, sizeof(buffer));
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  auto emit = [&](SegmentKind kind, std::string_view text) {
    events.push_back(Event{EventKind::kOutput, static_cast<int>(rank), pipe.stream, kind, std::string(text), {}});
  };
  if (n <= 0) {  // end of stream, or an error that ends it all the same
    pipe.lines.Finish(emit);
    FANRUN_WARN_NOT_OK(pipe.fd.Close(), "closing a rank's output");
    return;
  }
  const Rank& r = ranks_[rank];
  if (r.log.valid()) FANRUN_WARN_NOT_OK(WriteAll(r.log.fd(), buffer, static_cast<size_t>(n)), "writing a rank's log");
  pipe.lines.Feed(std::string_view(buffer, static_cast<size_t>(n)), emit);
  if (!pipe.lines.HoldsUnshown()) {
    pipe.show_held_at.reset();
  } else if (!pipe.show_held_at) {  // counted from the first byte held, so a trickle shows too
    pipe.show_held_at = Clock::now() + Seconds(options_.show_held_after_s);
  }
}

void Supervisor::ShowHeldOutput(Clock::time_point now, std::vector<Event>& events) {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    Rank& r = ranks_[i];
    if (r.exit) continue;
    for (OutputPipe* pipe : {r.out.get(), r.err.get()}) {
      if (!pipe->show_held_at || now < *pipe->show_held_at) continue;
      pipe->show_held_at.reset();
      pipe->lines.ShowHeld([&](SegmentKind kind, std::string_view text) {
        events.push_back(Event{EventKind::kOutput, static_cast<int>(i), pipe->stream, kind, std::string(text), {}});
      });
    }
  }
}

void Supervisor::PumpAvailable(size_t rank, OutputPipe& pipe, std::vector<Event>& events) {
  while (pipe.fd.valid()) {
    pollfd p{pipe.fd.fd(), POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) break;
    PumpStream(rank, pipe, events);
  }
}

void Supervisor::DrainStream(size_t rank, OutputPipe& pipe, std::vector<Event>& events) {
  // The rank has exited, so all it wrote is in the pipe: read to the end, but do not
  // wait for processes it left behind that still hold the pipe.
  PumpAvailable(rank, pipe, events);
  if (pipe.fd.valid()) {
    auto emit = [&](SegmentKind kind, std::string_view text) {
      events.push_back(Event{EventKind::kOutput, static_cast<int>(rank), pipe.stream, kind, std::string(text), {}});
    };
    pipe.lines.Finish(emit);
    FANRUN_WARN_NOT_OK(pipe.fd.Close(), "closing a rank's output");
  }
}

void Supervisor::PumpControl(size_t rank, std::vector<Event>& events) {
  Rank& r = ranks_[rank];
  char buffer[256];
  const ssize_t n = ::read(r.control.fd(), buffer, sizeof(buffer));
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) {
    FANRUN_WARN_NOT_OK(r.control.Close(), "closing a rank's control channel");
    return;
  }
  std::string_view read(buffer, static_cast<size_t>(n));
  if (r.control_line_dropped) {  // the rest of a line dropped, up to its end
    const size_t end = read.find('\n');
    if (end == std::string_view::npos) return;
    read.remove_prefix(end + 1);
    r.control_line_dropped = false;
  }
  r.control_buffer.append(read);
  size_t newline;
  while ((newline = r.control_buffer.find('\n')) != std::string::npos) {
    const std::string message = r.control_buffer.substr(0, newline);
    if (message.compare(0, kControlLog.size(), kControlLog) == 0) {
      const std::string digits = message.substr(kControlLog.size());
      const bool valid = !digits.empty() && digits.size() <= 8 &&
                         digits.find_first_not_of("0123456789") == std::string::npos &&
                         std::stoul(digits) <= kLongestLogText;
      if (!valid) {  // not one of fanrun's messages: dropped, like any unknown line
        r.control_buffer.erase(0, newline + 1);
        continue;
      }
      const size_t length = std::stoul(digits);
      if (r.control_buffer.size() < newline + 1 + length) break;  // the rest is on its way
      // What the rank wrote before it is in its pipes already: logged first, to keep the order.
      PumpAvailable(rank, *r.out, events);
      PumpAvailable(rank, *r.err, events);
      if (r.log.valid()) {
        FANRUN_WARN_NOT_OK(WriteAll(r.log.fd(), r.control_buffer.data() + newline + 1, length), "writing a rank's log");
      }
      r.control_buffer.erase(0, newline + 1 + length);
      continue;
    }
    r.control_buffer.erase(0, newline + 1);
    if (message == kControlFailed) {
      events.push_back(Event{EventKind::kRankFailed, static_cast<int>(rank), Stream::kStdout, SegmentKind::kLine, {}, {}});
      OnFailure(rank);
    } else if (message == kControlDone) {
      r.done = true;
    } else if (message == kControlKept && (r.done || abandoning_) && r.spare) {
      OnKept(rank, events);
      return;  // its channel waits for its next call now, not for more messages
    }
  }
  if (r.control_buffer.size() > kLongestControlLine && r.control_buffer.find('\n') == std::string::npos) {
    r.control_buffer.clear();
    r.control_line_dropped = true;
  }
}

void Supervisor::OnKept(size_t rank, std::vector<Event>& events) {
  Rank& r = ranks_[rank];
  // It flushed its output before it said so: all of it is in the pipes.
  DrainStream(rank, *r.out, events);
  DrainStream(rank, *r.err, events);
  r.kept = true;
  r.exit = ExitStatus{0, 0};
  events.push_back(Event{EventKind::kRankExited, static_cast<int>(rank), Stream::kStdout, SegmentKind::kLine, {}, *r.exit});
}

void Supervisor::OnExit(size_t rank, std::vector<Event>& events) {
  Rank& r = ranks_[rank];
  DrainStream(rank, *r.out, events);
  DrainStream(rank, *r.err, events);
  while (r.control.valid()) {
    pollfd p{r.control.fd(), POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) break;
    PumpControl(rank, events);
  }
  FANRUN_WARN_NOT_OK(r.control.Close(), "closing a rank's control channel");
  // What the rank started and left behind is gone already: its keeper exits only after that.
  events.push_back(Event{EventKind::kRankExited, static_cast<int>(rank), Stream::kStdout, SegmentKind::kLine, {}, *r.exit});
  if (!r.exit->success() || (options_.expect_done && !r.done)) OnFailure(rank);
  if (KilledFromOutsideJustAfterTheFirstFailure(*r.exit)) first_failed_rank_ = static_cast<int>(rank);
}

void Supervisor::OnFailure(size_t rank) {
  if (stop_reason_ != StopReason::kNone) return;  // a consequence, not the cause
  first_failed_rank_ = static_cast<int>(rank);
  first_failure_at_ = Clock::now();
  stop_reason_ = StopReason::kRankFailed;
  const bool others_run = std::any_of(ranks_.begin(), ranks_.end(), [&](const Rank& other) {
    return &other != &ranks_[rank] && other.process && !other.exit;
  });
  if (options_.failure_evidence_s > 0 && others_run) {
    evidence_until_ = *first_failure_at_ + Seconds(options_.failure_evidence_s);
  } else {
    StopAfterFailure(*first_failure_at_);
  }
}

void Supervisor::EndFailureEvidence() {
  if (!evidence_until_) return;
  evidence_until_.reset();
  StopAfterFailure(Clock::now());
}

void Supervisor::StopAfterFailure(Clock::time_point now) {
  if (options_.abandon_signal != 0) {
    Abandon(now);
  } else {
    Terminate(now);
  }
}

void Supervisor::Abandon(Clock::time_point now) {
  abandoning_ = true;
  abandon_until_ = now + Seconds(options_.kill_grace_s);
  for (auto& rank : ranks_) {
    if (rank.exit || !rank.process) continue;
    // To the rank alone: what it started is its call's, and the rank ends that itself. (The rank
    // that said "failed" is past its function already, and takes the signal as a no-op.)
    Status st = rank.spare ? rank.process->Signal(options_.abandon_signal) : rank.process->SignalAll(SIGTERM);
    FANRUN_WARN_NOT_OK(st, "telling a rank to abandon its call");
  }
}

bool Supervisor::KilledFromOutsideJustAfterTheFirstFailure(const ExitStatus& exit) const {
  if (stop_reason_ != StopReason::kRankFailed || exit.term_signal == 0) return false;
  // SIGTERM is what the supervisor sends everyone, and SIGKILL once the grace period is over.
  const bool sent_by_us = exit.term_signal == SIGTERM ||
                          (exit.term_signal == SIGKILL && sigkill_sent_at_ && exit.ended_at >= *sigkill_sent_at_) ||
                          (abandoning_ && exit.term_signal == options_.abandon_signal);
  return !sent_by_us && exit.ended_at - *first_failure_at_ <= Seconds(kPeerFailureWindowS);
}

void Supervisor::SignalRunning(int signo, bool with_descendants) {
  for (auto& rank : ranks_) {
    if (rank.exit || !rank.process) continue;
    Status st = with_descendants ? rank.process->SignalAll(signo) : rank.process->Signal(signo);
    FANRUN_WARN_NOT_OK(st, "signalling a rank");
  }
}

void Supervisor::Terminate(Clock::time_point now) {
  if (terminating_) return;
  terminating_ = true;
  dump_done_at_.reset();
  SignalRunning(SIGTERM, true);
  kill_at_ = now + Seconds(options_.kill_grace_s);
}

void Supervisor::Cancel() {
  if (stop_reason_ == StopReason::kNone) stop_reason_ = StopReason::kCancelled;
  evidence_until_.reset();
  Terminate(Clock::now());
}

void Supervisor::HandleDeadlines(Clock::time_point now, std::vector<Event>& events) {
  if (timeout_at_ && now >= *timeout_at_ && stop_reason_ == StopReason::kNone) {
    timeout_at_.reset();
    stop_reason_ = StopReason::kTimeout;
    events.push_back(Event{EventKind::kTimedOut, -1, Stream::kStdout, SegmentKind::kLine, {}, {}});
    for (size_t i = 0; i < ranks_.size(); ++i) {
      if (!ranks_[i].exit) running_at_timeout_.push_back(static_cast<int>(i));
    }
    if (options_.stack_dump_signal != 0) {
      SignalRunning(options_.stack_dump_signal, false);
      dump_done_at_ = now + Seconds(options_.stack_dump_wait_s);
    } else {
      Terminate(now);
    }
  }
  if (dump_done_at_ && now >= *dump_done_at_) Terminate(now);
  if (evidence_until_ && now >= *evidence_until_) EndFailureEvidence();
  if (abandon_until_ && now >= *abandon_until_) {  // the ranks not kept by now are stopped
    abandon_until_.reset();
    Terminate(now);
  }
  if (kill_at_ && now >= *kill_at_) {
    kill_at_.reset();
    sigkill_sent_at_ = now;
    SignalRunning(SIGKILL, true);
  }
}

bool Supervisor::AllReaped() const {
  return std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.exit.has_value(); });
}

int Supervisor::MillisecondsToNextDeadline(Clock::time_point now, std::optional<Clock::time_point> return_at) const {
  std::optional<Clock::time_point> next;
  auto consider = [&next](const std::optional<Clock::time_point>& deadline) {
    if (deadline && (!next || *deadline < *next)) next = deadline;
  };
  for (const auto& deadline : {timeout_at_, dump_done_at_, kill_at_, abandon_until_, evidence_until_, return_at}) {
    consider(deadline);
  }
  for (const auto& rank : ranks_) {
    if (rank.exit) continue;
    consider(rank.out->show_held_at);
    consider(rank.err->show_held_at);
  }
  if (!next) return -1;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*next - now).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 1 << 30));
}

Result<WaitResult> Supervisor::Wait(double max_wait_s, double gather_s) {
  WaitResult result;
  std::optional<Clock::time_point> return_at;
  if (max_wait_s >= 0) return_at = Clock::now() + Seconds(std::min(max_wait_s, kLongestPeriodS));
  std::optional<Clock::time_point> gathered_until;  // set by the first piece of output
  size_t seen = 0;  // events already looked at
  size_t gathered_bytes = 0;
  auto report_now = [&](Clock::time_point now) {
    for (; seen < result.events.size(); ++seen) {
      if (result.events[seen].kind != EventKind::kOutput) return true;
      if (!gathered_until) gathered_until = now + Seconds(std::min(std::max(gather_s, 0.0), kLongestPeriodS));
      gathered_bytes += result.events[seen].text.size();
    }
    return gathered_until && (now >= *gathered_until || gathered_bytes >= kMostGatheredBytes);
  };
  for (;;) {
    const auto now = Clock::now();
    HandleDeadlines(now, result.events);
    if (AllReaped()) {
      result.done = true;
      return result;
    }
    // The timeout struck (said while the ranks still run), or the output gathered is due.
    if (report_now(now)) return result;
    // fds[k] stands for slots[k]; the wakeup fd, last, has no slot.
    std::vector<pollfd> fds;
    std::vector<PollSlot> slots;
    auto watch = [&](int fd, size_t rank, Watched what) {
      fds.push_back({fd, POLLIN, 0});
      slots.push_back({rank, what});
    };
    for (size_t i = 0; i < ranks_.size(); ++i) {
      Rank& r = ranks_[i];
      if (r.exit) continue;
      watch(r.process->pidfd(), i, Watched::kExit);
      if (r.out->fd.valid()) watch(r.out->fd.fd(), i, Watched::kStdout);
      if (r.err->fd.valid()) watch(r.err->fd.fd(), i, Watched::kStderr);
      if (r.control.valid()) watch(r.control.fd(), i, Watched::kControl);
    }
    if (options_.wakeup_fd >= 0) fds.push_back({options_.wakeup_fd, POLLIN, 0});

    const auto wake_at = gathered_until && (!return_at || *gathered_until < *return_at) ? gathered_until : return_at;
    const int ready = ::poll(fds.data(), fds.size(), MillisecondsToNextDeadline(now, wake_at));
    if (ready < 0) {
      if (errno == EINTR) {
        result.interrupted = true;
        return result;
      }
      return Status::IOErrorFromErrno(errno, "poll failed while supervising the ranks");
    }
    for (size_t k = 0; k < slots.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const auto [i, what] = slots[k];
      Rank& r = ranks_[i];
      if (r.exit) continue;  // already handled in this round
      switch (what) {
        case Watched::kExit: {
          FANRUN_ASSIGN_OR_RETURN(std::optional<ExitStatus> status, r.process->TryReap());
          if (status) {
            r.exit = status;
            OnExit(i, result.events);
          }
          break;
        }
        case Watched::kStdout: PumpStream(i, *r.out, result.events); break;
        case Watched::kStderr: PumpStream(i, *r.err, result.events); break;
        case Watched::kControl: PumpControl(i, result.events); break;
      }
    }
    ShowHeldOutput(Clock::now(), result.events);
    if (options_.wakeup_fd >= 0 && fds.back().revents != 0) result.interrupted = true;
    if (result.interrupted || report_now(Clock::now())) return result;
    if (return_at && Clock::now() >= *return_at) return result;
  }
}

}  // namespace fanrun
