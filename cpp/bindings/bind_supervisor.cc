// Python access to the Supervisor: start a run, pump its events, stop it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "call_without_gil.h"
#include "fanrun/supervisor.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

const char* StopReasonName(StopReason reason) {
  switch (reason) {
    case StopReason::kNone: return "none";
    case StopReason::kRankFailed: return "rank_failed";
    case StopReason::kTimeout: return "timeout";
    case StopReason::kCancelled: return "cancelled";
  }
  return "none";
}

nb::object ExitToPython(const std::optional<ExitStatus>& exit) {
  if (!exit) return nb::none();
  return nb::make_tuple(exit->exit_code, exit->term_signal);
}

std::unique_ptr<Supervisor> StartSupervisor(const std::vector<std::vector<std::string>>& argvs,
                                            const std::vector<std::vector<std::string>>& envs,
                                            const std::string& cwd,
                                            const std::vector<std::string>& log_paths, double timeout_s,
                                            double kill_grace_s, int stack_dump_signal,
                                            double stack_dump_wait_s, int wakeup_fd,
                                            bool control_channel, bool expect_done,
                                            const std::string& keeper) {
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
  return ValueOrThrow(Supervisor::Start(std::move(options)));
}

// (events, interrupted, done); an event is (kind, rank, stream, segment, text, exit).
nb::tuple Wait(Supervisor& supervisor, double max_wait_s) {
  const WaitResult batch = CallWithoutGil([&] { return supervisor.Wait(max_wait_s); });
  nb::list events;
  for (const Event& event : batch.events) {
    events.append(nb::make_tuple(static_cast<int>(event.kind), event.rank, event.stream,
                                 static_cast<int>(event.segment),
                                 nb::bytes(event.text.data(), event.text.size()),
                                 nb::make_tuple(event.exit.exit_code, event.exit.term_signal)));
  }
  return nb::make_tuple(events, batch.interrupted, batch.done);
}

}  // namespace

void BindSupervisor(nb::module_& m) {
  m.attr("EVENT_OUTPUT") = static_cast<int>(EventKind::kOutput);
  m.attr("EVENT_RANK_FAILED") = static_cast<int>(EventKind::kRankFailed);
  m.attr("EVENT_RANK_EXITED") = static_cast<int>(EventKind::kRankExited);
  m.attr("EVENT_TIMED_OUT") = static_cast<int>(EventKind::kTimedOut);
  m.attr("SEGMENT_LINE") = static_cast<int>(SegmentKind::kLine);
  m.attr("SEGMENT_PARTIAL") = static_cast<int>(SegmentKind::kPartial);
  m.attr("SEGMENT_PROGRESS") = static_cast<int>(SegmentKind::kProgress);

  nb::class_<Supervisor>(m, "Supervisor")
      .def_static("start", &StartSupervisor, nb::arg("argvs"), nb::arg("envs"), nb::arg("cwd"),
                  nb::arg("log_paths"), nb::arg("timeout_s"), nb::arg("kill_grace_s"),
                  nb::arg("stack_dump_signal"), nb::arg("stack_dump_wait_s"), nb::arg("wakeup_fd"),
                  nb::arg("control_channel"), nb::arg("expect_done"), nb::arg("keeper"))
      .def("wait", &Wait, nb::arg("max_wait_s") = -1.0)
      .def("cancel", &Supervisor::Cancel)
      .def("kill_and_reap", [](Supervisor& s) { CallWithoutGil([&] { s.KillAndReap(); }); })
      .def_prop_ro("world_size", &Supervisor::world_size)
      .def_prop_ro("first_failed_rank", &Supervisor::first_failed_rank)
      .def_prop_ro("stop_reason", [](const Supervisor& s) { return StopReasonName(s.stop_reason()); })
      .def_prop_ro("ranks_running_at_timeout", &Supervisor::ranks_running_at_timeout)
      .def("pid", &Supervisor::pid)
      .def("log_path", &Supervisor::log_path)
      .def("exit_status", [](const Supervisor& s, int rank) { return ExitToPython(s.exit_status(rank)); });
}

}  // namespace fanrun::bindings
