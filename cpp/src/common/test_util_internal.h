// Helpers shared by the engine's tests.
#pragma once

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

namespace fanrun::testing {

inline std::vector<std::string> ShellCommand(const std::string& script) { return {"/bin/sh", "-c", script}; }

inline std::vector<std::string> MinimalEnv() { return {"PATH=/usr/bin:/bin", "LC_ALL=C"}; }

// The fanrun-keeper built beside the tests.
inline std::string KeeperPath() { return FANRUN_TEST_KEEPER; }

// A fresh directory /tmp/<prefix>-XXXXXX for one test; "" if it could not be made.
inline std::string MakeTempDir(const std::string& prefix) {
  std::string pattern = "/tmp/" + prefix + "-XXXXXX";
  return ::mkdtemp(pattern.data()) != nullptr ? pattern : std::string();
}

// Removes a test's directory and everything in it; true when that worked.
inline bool RemoveTree(const std::string& path) { return std::system(("rm -rf '" + path + "'").c_str()) == 0; }

// True once `pid` has exited (or never existed), waiting at most `timeout_ms`.
inline bool ProcessGoneWithin(pid_t pid, int timeout_ms) {
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return errno == ESRCH;
  pollfd p{pidfd, POLLIN, 0};
  const int ready = ::poll(&p, 1, timeout_ms);
  ::close(pidfd);
  return ready == 1;
}

}  // namespace fanrun::testing
