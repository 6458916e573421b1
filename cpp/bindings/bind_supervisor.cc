// Python access to the Supervisor: a run's options as named fields, started, its events pumped as
// read-only objects, stopped; and spare ranks, started ahead of a call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "call_without_gil.h"
#include "fanrun/run_contract.h"
#include "fanrun/spare_rank.h"
#include "fanrun/spare_zygote.h"
#include "fanrun/supervisor.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

using ExitTuple = std::tuple<int, int>;  // (exit code, signal)
using EventList = nb::typed<nb::list, Event>;
using WaitTuple = std::tuple<EventList, bool, bool>;  // (events, interrupted, done)
// What a pickled event holds: its fields in the order Event's constructor names them.
using EventState = std::tuple<EventKind, int, Stream, SegmentKind, nb::bytes, int, int>;

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

SpareZygote StartZygote(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                        const std::string& cwd) {
  SpawnOptions spawn;
  spawn.argv = argv;
  spawn.env = env;
  spawn.cwd = cwd;
  return CallWithoutGil([&] { return SpareZygote::Start(std::move(spawn)); });
}

std::unique_ptr<Supervisor> StartSupervisor(SupervisorOptions options, const std::vector<PySpareRank*>& spares) {
  std::vector<SpareRank> taken;
  for (PySpareRank* spare : spares) {
    taken.push_back(std::move(spare->get()));
    spare->spare.reset();
  }
  return ValueOrThrow(Supervisor::Start(std::move(options), std::move(taken)));
}

// Every line of every rank passes here: each event is moved into its Python object, its text
// copied once, into the bytes that Event.data hands out.
WaitTuple Wait(Supervisor& supervisor, double max_wait_s, double gather_s) {
  WaitResult batch = CallWithoutGil([&] { return supervisor.Wait(max_wait_s, gather_s); });
  EventList events;
  for (Event& event : batch.events) events.append(nb::cast(std::move(event), nb::rv_policy::move));
  return {std::move(events), batch.interrupted, batch.done};
}

Event MakeEvent(EventKind kind, int rank, Stream stream, SegmentKind segment, const nb::bytes& data, int exit_code,
                int signal) {
  return Event{kind, rank, stream, segment, std::string(data.c_str(), data.size()), ExitStatus{exit_code, signal}};
}

void BindRankOptions(nb::module_& m) {
  nb::class_<RankOptions>(m, "RankOptions", "One rank of a run: what it runs, where, and where its log goes.")
      .def(
          "__init__",
          [](RankOptions* self, std::vector<std::string> argv, std::vector<std::string> env, std::string log_path,
             std::string cwd) {
            RankOptions* rank = new (self) RankOptions();
            rank->spawn.argv = std::move(argv);
            rank->spawn.env = std::move(env);
            rank->spawn.cwd = std::move(cwd);
            rank->log_path = std::move(log_path);
          },
          nb::kw_only(), nb::arg("argv"), nb::arg("env"), nb::arg("log_path"), nb::arg("cwd") = std::string())
      .def_prop_rw(
          "argv", [](const RankOptions& r) { return r.spawn.argv; },
          [](RankOptions& r, std::vector<std::string> argv) { r.spawn.argv = std::move(argv); },
          "What the rank runs; argv[0] is looked up in the PATH of env when it has no '/'.")
      .def_prop_rw(
          "env", [](const RankOptions& r) { return r.spawn.env; },
          [](RankOptions& r, std::vector<std::string> env) { r.spawn.env = std::move(env); },
          "The rank's whole environment, \"NAME=value\" each.")
      .def_prop_rw(
          "cwd", [](const RankOptions& r) { return r.spawn.cwd; },
          [](RankOptions& r, std::string cwd) { r.spawn.cwd = std::move(cwd); },
          "Its working directory; empty: the caller's.")
      .def_rw("log_path", &RankOptions::log_path, "Where everything it writes to stdout and stderr goes, byte for byte.");
}

void BindSupervisorOptions(nb::module_& m) {
  const SupervisorOptions defaults;
  nb::class_<SupervisorOptions>(m, "SupervisorOptions", "One run, as Supervisor.start takes it (supervisor.h).")
      .def(
          "__init__",
          [](SupervisorOptions* self, std::vector<RankOptions> ranks, std::string keeper_path, double timeout_s,
             double kill_grace_s, int stack_dump_signal, double stack_dump_wait_s, int wakeup_fd, bool control_channel,
             bool expect_done, size_t max_line_bytes, double show_held_after_s, int abandon_signal,
             double failure_evidence_s) {
            SupervisorOptions* options = new (self) SupervisorOptions();
            options->ranks = std::move(ranks);
            options->keeper_path = std::move(keeper_path);
            options->timeout_s = timeout_s;
            options->kill_grace_s = kill_grace_s;
            options->stack_dump_signal = stack_dump_signal;
            options->stack_dump_wait_s = stack_dump_wait_s;
            options->wakeup_fd = wakeup_fd;
            options->control_channel = control_channel;
            options->expect_done = expect_done;
            options->max_line_bytes = max_line_bytes;
            options->show_held_after_s = show_held_after_s;
            options->abandon_signal = abandon_signal;
            options->failure_evidence_s = failure_evidence_s;
          },
          nb::kw_only(), nb::arg("ranks"), nb::arg("keeper_path"), nb::arg("timeout_s") = defaults.timeout_s,
          nb::arg("kill_grace_s") = defaults.kill_grace_s, nb::arg("stack_dump_signal") = defaults.stack_dump_signal,
          nb::arg("stack_dump_wait_s") = defaults.stack_dump_wait_s, nb::arg("wakeup_fd") = defaults.wakeup_fd,
          nb::arg("control_channel") = defaults.control_channel, nb::arg("expect_done") = defaults.expect_done,
          nb::arg("max_line_bytes") = defaults.max_line_bytes,
          nb::arg("show_held_after_s") = defaults.show_held_after_s, nb::arg("abandon_signal") = defaults.abandon_signal,
          nb::arg("failure_evidence_s") = defaults.failure_evidence_s)
      .def_rw("ranks", &SupervisorOptions::ranks, "One RankOptions per rank, in rank order (read and set whole).")
      .def_rw("keeper_path", &SupervisorOptions::keeper_path,
              "The fanrun-keeper executable, which ends every process a rank started when the rank ends.")
      .def_rw("timeout_s", &SupervisorOptions::timeout_s, "The run's timeout; 0 or less: none.")
      .def_rw("kill_grace_s", &SupervisorOptions::kill_grace_s, "From SIGTERM to SIGKILL when the run stops early.")
      .def_rw("stack_dump_signal", &SupervisorOptions::stack_dump_signal,
              "Sent to every rank at the timeout, before the kill; 0: none.")
      .def_rw("stack_dump_wait_s", &SupervisorOptions::stack_dump_wait_s, "How long the ranks get to write their stacks.")
      .def_rw("wakeup_fd", &SupervisorOptions::wakeup_fd,
              "Supervisor.wait returns 'interrupted' when this descriptor becomes readable; -1: none.")
      .def_rw("control_channel", &SupervisorOptions::control_channel,
              "Give each rank its control channel at CONTROL_FD (run_contract.h).")
      .def_rw("expect_done", &SupervisorOptions::expect_done,
              "A rank that exits 0 without having sent CONTROL_DONE has failed.")
      .def_rw("max_line_bytes", &SupervisorOptions::max_line_bytes,
              "A longer line is reported in PARTIAL segments of this many bytes.")
      .def_rw("show_held_after_s", &SupervisorOptions::show_held_after_s,
              "Output held for the rest of its line is shown once held this long.")
      .def_rw("abandon_signal", &SupervisorOptions::abandon_signal,
              "After a rank's failure, sent to the other ranks that were spares instead of SIGTERM: they\n"
              "abandon the call and survive for the next attempt (release_survivors); 0: none.")
      .def_rw("failure_evidence_s", &SupervisorOptions::failure_evidence_s,
              "After the first failure, how long the ranks still running are left as they are for the caller\n"
              "to ask them what they were doing (end_failure_evidence ends it sooner); 0: stopped at once.");
}

void BindEvent(nb::module_& m) {
  nb::class_<Event>(m, "Event",
                    "What happened in a run, as Supervisor.wait reports it; read-only. stream, segment and data\n"
                    "are an OUTPUT's; exit_code and signal a RANK_EXITED's (-1 and 0 otherwise); rank is -1 for\n"
                    "TIMED_OUT, which is the run's.")
      .def("__init__",
           [](Event* self, EventKind kind, int rank, Stream stream, SegmentKind segment, const nb::bytes& data,
              int exit_code, int signal) { new (self) Event(MakeEvent(kind, rank, stream, segment, data, exit_code, signal)); },
           nb::kw_only(), nb::arg("kind"), nb::arg("rank"), nb::arg("stream") = Stream::kStdout,
           nb::arg("segment") = SegmentKind::kLine, nb::arg("data") = nb::bytes("", 0), nb::arg("exit_code") = -1,
           nb::arg("signal") = 0)
      .def_ro("kind", &Event::kind)
      .def_ro("rank", &Event::rank)
      .def_ro("stream", &Event::stream)
      .def_ro("segment", &Event::segment)
      .def_prop_ro("data", [](const Event& e) { return nb::bytes(e.text.data(), e.text.size()); },
                   "The piece of output, its line ending left out.")
      .def_prop_ro("exit_code", [](const Event& e) { return e.exit.exit_code; }, "When the rank exited; else -1.")
      .def_prop_ro("signal", [](const Event& e) { return e.exit.term_signal; }, "When a signal ended the rank; else 0.")
      .def(
          "with_rank",
          [](const Event& e, int rank) {
            Event renumbered = e;
            renumbered.rank = rank;
            return renumbered;
          },
          nb::arg("rank"), "The same event, of rank `rank`: a node's event among the whole run's ranks.")
      // Events cross from a cluster's node agents to the caller pickled.
      .def("__getstate__",
           [](const Event& e) {
             return EventState{e.kind,    e.rank, e.stream, e.segment, nb::bytes(e.text.data(), e.text.size()),
                               e.exit.exit_code, e.exit.term_signal};
           })
      .def("__setstate__",
           [](Event& e, const EventState& s) {
             new (&e) Event(MakeEvent(std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s), std::get<4>(s),
                                      std::get<5>(s), std::get<6>(s)));
           })
      .def("__repr__", [](const Event& e) {
        return nb::str("Event(kind={!s}, rank={}, stream={!s}, segment={!s}, data={!r}, exit_code={}, signal={})")
            .format(e.kind, e.rank, e.stream, e.segment, nb::bytes(e.text.data(), e.text.size()), e.exit.exit_code,
                    e.exit.term_signal);
      });
}

}  // namespace

void BindSupervisor(nb::module_& m) {
  BindRankOptions(m);
  BindSupervisorOptions(m);
  BindEvent(m);

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

  nb::class_<SpareZygote>(m, "SpareZygote",
                          "An interpreter with the spares' imports done, which forks spares ready at once\n"
                          "(spare_zygote.h). It ends when dropped; the spares forked from it do not.")
      .def_static("start", &StartZygote, nb::arg("argv"), nb::arg("env"), nb::arg("cwd"))
      .def_prop_ro("pid", &SpareZygote::pid)
      .def("alive", &SpareZygote::alive)
      .def("kill", [](SpareZygote& z) { ThrowIfError(z.Kill()); }, "SIGKILL: its imports end, and WaitReady with them.")
      .def(
          "wait_ready",
          [](SpareZygote& z, double timeout_s) { return CallWithoutGil([&] { return z.WaitReady(timeout_s); }); },
          nb::arg("timeout_s"), "Whether its imports are done, waiting up to timeout_s for them.")
      .def(
          "fork",
          [](SpareZygote& z, const std::string& keeper) {
            return PySpareRank{CallWithoutGil([&] { return z.Fork(keeper); })};
          },
          nb::arg("keeper"), "A spare forked from it, under a keeper of its own, ready for its call.");

  nb::class_<Supervisor>(m, "Supervisor")
      .def_static("start", &StartSupervisor, nb::arg("options"), nb::arg("spares") = std::vector<PySpareRank*>{},
                  "Starts every rank of `options`. Rank i < len(spares) is spares[i], handed its call; each spare is\n"
                  "spent, whatever happens.")
      .def("wait", &Wait, nb::arg("max_wait_s") = -1.0, nb::arg("gather_s") = 0.0,
           "(events, interrupted, done). With max_wait_s >= 0 it returns after that long at the latest, even\n"
           "with no events. Output is gathered for gather_s after its first piece, any other event reported at once.")
      .def("cancel", &Supervisor::Cancel)
      .def_prop_ro("gathering_failure_evidence", &Supervisor::gathering_failure_evidence,
                   "The first failure has come, and the ranks still running are left as they are\n"
                   "(failure_evidence_s) for the caller to ask them what they were doing.")
      .def("end_failure_evidence", &Supervisor::EndFailureEvidence,
           "Stops the ranks after the first failure now, as failure_evidence_s would once it is over.")
      .def(
          "release_kept",
          [](Supervisor& s) {
            std::vector<PySpareRank> released;
            for (SpareRank& spare : ValueOrThrow(s.ReleaseKept())) released.push_back(PySpareRank{std::move(spare)});
            return released;
          },
          "Once every rank said it is kept and the run did not stop early: the ranks, in rank order,\n"
          "as spares for the next call; otherwise [], and they end with kill_and_reap().")
      .def(
          "release_survivors",
          [](Supervisor& s) {
            std::vector<std::optional<PySpareRank>> released;
            for (std::optional<SpareRank>& spare : ValueOrThrow(s.ReleaseSurvivors())) {
              if (spare) {
                released.emplace_back(PySpareRank{std::move(spare)});
              } else {
                released.emplace_back();
              }
            }
            return released;
          },
          "After a failure, with abandon_signal: for each rank in rank order, the rank as a spare for the\n"
          "next attempt where it abandoned its call in time, else None (the rank whose failure started\n"
          "it, or one that ended); ranks not released end with kill_and_reap().")
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
