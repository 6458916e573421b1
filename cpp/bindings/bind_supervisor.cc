// Python access to the Supervisor: start a run, pump its events, stop it; and to spare ranks,
// started ahead of a call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <tuple>

#include "call_without_gil.h"
#include "fanrun/run_contract.h"
#include "fanrun/spare_rank.h"
#include "fanrun/supervisor.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

using ExitTuple = std::tuple<int, int>;  // (exit code, signal)
using EventTuple = std::tuple<EventKind, int, int, SegmentKind, nb::bytes, ExitTuple>;
//                            (kind, rank, stream, segment, text, exit)
using WaitTuple = std::tuple<std::vector<EventTuple>, bool, bool>;  // (events, interrupted, done)

ExitTuple ExitToPython(const ExitStatus& exit) { return {exit.exit_code, exit.term_signal}; }

// A spare rank as Python holds it: empty once a supervisor has taken it.
struct PySpareRank {
  std::optional<SpareRank> spare;

  SpareRank& get() {
    if (!spare) ThrowIfError(Status::Invalid("This spare rank has been handed a call already"));
    return *spare;
  }
};

PySpareRank StartSpare(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                       const std::string& cwd, const std::string& keeper) {
  SpawnOptions spawn;
  spawn.argv = argv;
  spawn.env = env;
  spawn.cwd = cwd;
  // Released: spares start in a thread of their own while the caller's code goes on.
  return PySpareRank{CallWithoutGil([&] { return SpareRank::Start(keeper, std::move(spawn)); })};
}

std::unique_ptr<Supervisor> StartSupervisor(const std::vector<std::vector<std::string>>& argvs,
                                            const std::vector<std::vector<std::string>>& envs,
                                            const std::string& cwd,
                                            const std::vector<std::string>& log_paths, double timeout_s,
                                            double kill_grace_s, int stack_dump_signal,
                                            double stack_dump_wait_s, int wakeup_fd,
                                            bool control_channel, bool expect_done,
                                            const std::string& keeper, const std::vector<PySpareRank*>& spares) {
  if (argvs.size() != envs.size() || argvs.size() != log_paths.size()) {
    ThrowIfError(Status::Invalid("argvs, envs and log_paths must have one entry per rank"));
  }
  SupervisorOptions options;
  for (size_t i = 0; i < argvs.size(); ++i) {
    RankOptions rank;
    rank.spawn.argv = argvs[i];
    rank.spawn.env = envs[i];
    rank.spawn.cwd = cwd;
    rank.log_path = log_paths[i];
    options.ranks.push_back(std::move(rank));
  }
  options.timeout_s = timeout_s;
  options.kill_grace_s = kill_grace_s;
  options.stack_dump_signal = stack_dump_signal;
  options.stack_dump_wait_s = stack_dump_wait_s;
  options.wakeup_fd = wakeup_fd;
  options.control_channel = control_channel;
  options.expect_done = expect_done;
  options.keeper_path = keeper;
  std::vector<SpareRank> taken;
  for (PySpareRank* spare : spares) {
    taken.push_back(std::move(spare->get()));
    spare->spare.reset();
  }
  return ValueOrThrow(Supervisor::Start(std::move(options), std::move(taken)));
}

WaitTuple Wait(Supervisor& supervisor, double max_wait_s, double gather_s) {
  const WaitResult batch = CallWithoutGil([&] { return supervisor.Wait(max_wait_s, gather_s); });
  std::vector<EventTuple> events;
  events.reserve(batch.events.size());
  for (const Event& event : batch.events) {
    events.emplace_back(event.kind, event.rank, event.stream, event.segment,
                        nb::bytes(event.text.data(), event.text.size()), ExitToPython(event.exit));
  }
  return {std::move(events), batch.interrupted, batch.done};
}

}  // namespace

void BindSupervisor(nb::module_& m) {
  // The run contract (run_contract.h); src/fanrun/_run_contract.py holds the same messages.
  m.attr("CONTROL_FD") = kControlFd;
  m.attr("CONTROL_FAILED") = std::string(kControlFailed);
  m.attr("CONTROL_DONE") = std::string(kControlDone);
  m.attr("CONTROL_LOG") = std::string(kControlLog);
  m.attr("SPARE_CALL") = std::string(kSpareCall);
  m.attr("SPARE_READY") = std::string(kSpareReady);
  m.attr("CONTROL_KEPT") = std::string(kControlKept);
  nb::enum_<EventKind>(m, "EventKind", "What Supervisor.wait reports.")
      .value("OUTPUT", EventKind::kOutput, "A piece of a rank's output: (stream, segment, text).")
      .value("RANK_FAILED", EventKind::kRankFailed, "A rank reported its failure on its control channel.")
      .value("RANK_EXITED", EventKind::kRankExited, "A rank has exited and been reaped: (exit code, signal).")
      .value("TIMED_OUT", EventKind::kTimedOut,
             "The timeout struck just now: the stack-dump signal is out, the ranks still run.");
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

  nb::class_<PySpareRank>(m, "SpareRank",
                           "A rank started ahead of its call, under a keeper, its output on /dev/null;\n"
                           "Supervisor.start(spares=...) hands it its call (spare_rank.h).")
      .def_static("start", &StartSpare, nb::arg("argv"), nb::arg("env"), nb::arg("cwd"), nb::arg("keeper"))
      .def_prop_ro("pid", [](PySpareRank& s) { return s.get().pid(); })
      .def("waiting", [](PySpareRank& s) { return s.spare && s.spare->waiting(); },
           "False once it has been handed a call, or its program has ended.")
      .def(
          "wait_ready",
          [](PySpareRank& s, double timeout_s) {
            SpareRank& spare = s.get();
            return CallWithoutGil([&] { return spare.WaitReady(timeout_s); });
          },
          nb::arg("timeout_s"), "Whether its imports are done, waiting up to timeout_s for them.");

  nb::class_<Supervisor>(m, "Supervisor")
      .def_static("start", &StartSupervisor, nb::arg("argvs"), nb::arg("envs"), nb::arg("cwd"),
                  nb::arg("log_paths"), nb::arg("timeout_s"), nb::arg("kill_grace_s"),
                  nb::arg("stack_dump_signal"), nb::arg("stack_dump_wait_s"), nb::arg("wakeup_fd"),
                  nb::arg("control_channel"), nb::arg("expect_done"), nb::arg("keeper"),
                  nb::arg("spares") = std::vector<PySpareRank*>{},
                  "Rank i < len(spares) is spares[i], handed its call; each spare is spent, whatever happens.")
      .def("wait", &Wait, nb::arg("max_wait_s") = -1.0, nb::arg("gather_s") = 0.0,
           "(events, interrupted, done); an event is (kind, rank, stream, segment, text, (exit code, signal)),\n"
           "stream 1 for stdout and 2 for stderr. With max_wait_s >= 0 it returns after that long at the\n"
           "latest, even with no events. Output is gathered for gather_s after its first piece, any\n"
           "other event reported at once.")
      .def("cancel", &Supervisor::Cancel)
      .def(
          "release_kept",
          [](Supervisor& s) {
            std::vector<PySpareRank> released;
            for (SpareRank& spare : ValueOrThrow(s.ReleaseKept())) released.push_back(PySpareRank{std::move(spare)});
            return released;
          },
          "Once every rank said it is kept and the run did not stop early: the ranks, in rank order,\n"
          "as spares for the next call; otherwise [], and they end with kill_and_reap().")
      .def("kill_and_reap", [](Supervisor& s) { CallWithoutGil([&] { s.KillAndReap(); }); })
      .def_prop_ro("world_size", &Supervisor::world_size)
      .def_prop_ro("first_failed_rank", &Supervisor::first_failed_rank)
      .def_prop_ro("stop_reason", &Supervisor::stop_reason)
      .def_prop_ro("ranks_running_at_timeout", &Supervisor::ranks_running_at_timeout)
      .def("pid", &Supervisor::pid, nb::arg("rank"))
      .def("log_path", &Supervisor::log_path, nb::arg("rank"))
      .def(
          "exit_status",
          [](const Supervisor& s, int rank) -> std::optional<ExitTuple> {
            const std::optional<ExitStatus> exit = s.exit_status(rank);
            if (!exit) return std::nullopt;
            return ExitToPython(*exit);
          },
          nb::arg("rank"), "(exit code, signal) once the rank has exited, else None.");
}

}  // namespace fanrun::bindings
