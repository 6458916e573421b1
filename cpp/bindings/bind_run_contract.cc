// The run contract's engine half (run_contract.h) for Python: the control channel's messages as
// constants, and what the engine reports up as enums.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "fanrun/run_contract.h"

namespace nb = nanobind;

namespace fanrun::bindings {

void BindRunContract(nb::module_& m) {
  // src/fanrun/_rank/contract.py holds the same messages; tests/test_run_contract.py, both halves equal.
  m.attr("CONTROL_FD") = kControlFd;
  m.attr("CONTROL_FAILED") = std::string(kControlFailed);
  m.attr("CONTROL_DONE") = std::string(kControlDone);
  m.attr("CONTROL_LOG") = std::string(kControlLog);
  m.attr("SPARE_CALL") = std::string(kSpareCall);
  m.attr("SPARE_READY") = std::string(kSpareReady);
  m.attr("ZYGOTE_FORK") = std::string(kZygoteFork);
  m.attr("CONTROL_KEPT") = std::string(kControlKept);
  nb::enum_<EventKind>(m, "EventKind", "What Supervisor.wait reports.")
      .value("OUTPUT", EventKind::kOutput, "A piece of a rank's output: Event.stream, .segment and .data.")
      .value("RANK_FAILED", EventKind::kRankFailed, "A rank reported its failure on its control channel.")
      .value("RANK_EXITED", EventKind::kRankExited, "A rank has exited and been reaped: Event.exit_code and .signal.")
      .value("TIMED_OUT", EventKind::kTimedOut,
             "The timeout struck just now: the stack-dump signal is out, the ranks still run.");
  // An IntEnum, numbered as the descriptors: the display keys every line by its stream, and an
  // IntEnum hashes as fast as an int where a plain Enum's hash runs Python code.
  nb::enum_<Stream>(m, "Stream", nb::is_arithmetic(), "Which of a rank's output streams a piece of output came from.")
      .value("STDOUT", Stream::kStdout, "The rank's standard output, descriptor 1.")
      .value("STDERR", Stream::kStderr, "The rank's standard error, descriptor 2.");
  nb::enum_<SegmentKind>(m, "SegmentKind", "What a piece of a rank's output is.")
      .value("LINE", SegmentKind::kLine, "A line, ended by a newline or by the end of the stream.")
      .value("PARTIAL", SegmentKind::kPartial,
             "The start of a line not ended yet; the segments that follow go on with the same line.")
      .value("PROGRESS", SegmentKind::kProgress, "The current text of a line being redrawn with a carriage return.");
  nb::enum_<StopReason>(m, "StopReason", "Why a run stopped early.")
      .value("NONE", StopReason::kNone, "It has not.")
      .value("RANK_FAILED", StopReason::kRankFailed, "A rank failed: Supervisor.first_failed_rank.")
      .value("TIMEOUT", StopReason::kTimeout, "The timeout struck: Supervisor.ranks_running_at_timeout.")
      .value("CANCELLED", StopReason::kCancelled, "Supervisor.cancel() was called.");
}

}  // namespace fanrun::bindings
