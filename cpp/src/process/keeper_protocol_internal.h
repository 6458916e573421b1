// What a rank keeper (fanrun-keeper, keeper_main.cc) and its owner (KeptProcess) say to each
// other over one SOCK_SEQPACKET socket, the keeper's standard input. One message a packet.
#pragma once

#include <cstdint>

namespace fanrun::keeper {

// The keeper's argv: fanrun-keeper <owner pid> <directory> <program path> <program argv...>;
// an empty directory leaves the keeper's own.
constexpr int kOwnerArg = 1;
constexpr int kDirectoryArg = 2;
constexpr int kPathArg = 3;
constexpr int kProgramArgs = 4;
// Or: fanrun-keeper --adopt <program pid>, exec'd by the parent of a program that is already
// its child (a spare zygote's fork: spare_zygote.h). Its owner is whoever holds the other end
// of its channel; it has no parent to outlive.
constexpr const char* kAdoptArg = "--adopt";

// Owner -> keeper. The owner closing its side means: kill everything and leave.
enum class Scope : int32_t {
  kProgram = 0,  // the program alone (a stack dump)
  kAll = 1,      // the program and every process it started, in any group or session
};
struct Command {
  int32_t signo;
  Scope scope;
};

// Keeper -> owner.
enum class ReportKind : int32_t {
  kStarted = 1,  // value: the program's pid
  kStartFailed,  // value: a StatusCode; the message text follows in the same packet
  kEnded,        // value: exit code, signal: the signal that ended it (0 if none), ended_ns: when
};
struct Report {
  ReportKind kind;
  int32_t value;
  int32_t signal;
  int32_t unused;  // ended_ns aligned without padding bytes of no value
  // kEnded: when the keeper reaped the program, in nanoseconds of CLOCK_MONOTONIC (the owner's
  // std::chrono::steady_clock).
  int64_t ended_ns;
};

// The longest packet: a report and its message.
constexpr int kMaxPacket = 4096;

}  // namespace fanrun::keeper
