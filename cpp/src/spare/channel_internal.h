// What spare ranks and spare zygotes share on their control channels (Unix stream sockets).
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "fanrun/fd.h"
#include "fanrun/process.h"
#include "fanrun/status.h"

namespace fanrun::spare {

// How a spare or a zygote starts: its control channel a socket, and its output /dev/null (what
// it prints while it imports is no call's). Set into the options it is spawned with, which
// hold `theirs` and `null` until then; `ours` is the caller's end.
struct QuietStart {
  FileDescriptor ours, theirs, null;
};
// `whose`: "a spare rank's", named in the error.
Result<QuietStart> PrepareQuietStart(SpawnOptions* options, const std::string& whose);

// Sends `message` with `fds` attached to its first bytes (SCM_RIGHTS); the rest follows as a
// stream. `who` names the other end in errors.
Status SendWithDescriptors(int channel, std::string_view message, std::initializer_list<int> fds,
                           const std::string& who);

// Whether the other end has written `line` and a newline, waiting up to timeout_s; what it has
// written so far accumulates in *said. False too once it has ended.
Result<bool> WaitForLine(int channel, std::string_view line, double timeout_s, std::string* said);

}  // namespace fanrun::spare
