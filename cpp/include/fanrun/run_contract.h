// The run contract, the engine's half: the messages a rank sends on its control channel, and
// the kinds of what the engine reports up (events, output streams and segments, why a run stopped).
//
// The Python half is src/fanrun/_rank/contract.py. The bindings hand these to Python as
// fanrun._core's CONTROL_* constants and its EventKind, Stream, SegmentKind and StopReason enums;
// tests/test_run_contract.py holds the two halves equal.
#pragma once

#include <string_view>

namespace fanrun {

// The control channel: a pipe at this descriptor in every rank, one message a line.
inline constexpr int kControlFd = 3;
// "My error is written, I am failing": the engine stops the other ranks at once.
inline constexpr std::string_view kControlFailed = "failed";
// "My result is written": with expect_done, a rank that exits 0 without it has failed.
inline constexpr std::string_view kControlDone = "done";
// Followed by the length in decimal and a newline, then that many bytes, which go to the rank's
// log alone, after what its pipes hold: the traceback of its failure, which the caller shows
// with its exception, so that it is not shown twice.
inline constexpr std::string_view kControlLog = "log ";
// The other way, to a spare rank (spare_rank.h), whose control channel is a socket: the call it
// becomes. This word, the body's length in decimal and a newline, with the rank's stdout and
// stderr attached (SCM_RIGHTS); then the body: its directory, the count of its argv, its argv and
// its environment, each string ended by a NUL.
inline constexpr std::string_view kSpareCall = "call ";
// A spare rank's one line before its call: its imports are done. (A supervisor that reads it
// after the handover drops it, as any line that is none of the above.)
inline constexpr std::string_view kSpareReady = "ready";
// To a spare zygote (spare_zygote.h), which says kSpareReady once its imports are done: fork a
// spare. This word, the path of fanrun-keeper and a newline, with two descriptors attached
// (SCM_RIGHTS): the forked keeper's channel and the spare's control channel. It answers the
// keeper's pid in decimal and a newline.
inline constexpr std::string_view kZygoteFork = "fork ";
// From a rank that was a spare, after kControlDone: "my output is flushed, my stdout and stderr
// are no longer the call's, and I wait on my control channel for another call". The call is
// over for it without an exit; Supervisor::ReleaseKept hands it on as a spare (keep_alive).
inline constexpr std::string_view kControlKept = "kept";

// Which of a rank's output streams a piece of output came from, numbered as its descriptor.
enum class Stream { kStdout = 1, kStderr = 2 };

// What a piece of a rank's output is.
enum class SegmentKind {
  kLine,      // ended by '\n' (or "\r\n"), or by the end of the stream
  kPartial,   // the start of a line not ended yet (longer than the limit, or held too long);
              // the segments that follow go on with the same line
  kProgress,  // the current text of a line being redrawn with '\r' (a progress bar)
};

// What the supervisor reports. kTimedOut: the timeout struck just now; the stack-dump signal
// is out, the ranks still run.
enum class EventKind { kOutput, kRankFailed, kRankExited, kTimedOut };

// Why a run stopped early; kNone while it has not.
enum class StopReason { kNone, kRankFailed, kTimeout, kCancelled };

}  // namespace fanrun
