// Making a checkpoint directory visible in one atomic step, durably.
#pragma once

#include <string>

#include "fanrun/status.h"

namespace fanrun {

// fsyncs a directory, so that the entries created or renamed in it survive a crash.
Status SyncDirectory(const std::string& path);

// Moves the complete checkpoint `staging` to `target` in one rename and fsyncs both parent
// directories. If `target` exists it is swapped with `staging` atomically
// (renameat2 RENAME_EXCHANGE), so that `target` always holds one complete checkpoint; the
// previous one is then at the returned path, for the caller to remove. Returns "" when there
// was no previous one. Filesystems without RENAME_EXCHANGE get two renames instead (the
// previous checkpoint is moved aside first), which leaves a moment with nothing at `target`.
Result<std::string> PublishDirectory(const std::string& staging, const std::string& target);

}  // namespace fanrun
