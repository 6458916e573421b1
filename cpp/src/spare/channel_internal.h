// What spare ranks and spare zygotes share on their control channels (Unix stream sockets).
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "fanrun/status.h"

namespace fanrun::spare {

// Sends `message` with `fds` attached to its first bytes (SCM_RIGHTS); the rest follows as a
// stream. `who` names the other end in errors.
Status SendWithDescriptors(int channel, std::string_view message, std::initializer_list<int> fds,
                           const std::string& who);

// Whether the other end has written `line` and a newline, waiting up to timeout_s; what it has
// written so far accumulates in *said. False too once it has ended.
Result<bool> WaitForLine(int channel, std::string_view line, double timeout_s, std::string* said);

}  // namespace fanrun::spare
