"""One attempt of a call: start every rank through a backend, relay its output, wait, and turn the
outcome into the ranks' results or the root cause's exception."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Mapping

from .. import _core, backends
from .._display.output import OutputMux
from .._errors import RemoteTraceback
from .._rank import contract
from .._spec.paths import RunPaths
from .._spec.spec import CallSpec, Launch
from ..backends.base import Ranks
from ..backends.local.spares import KeptRanks
from . import hints, running_calls
from .outcome import TimeoutReport, collect
from .signals import SignalWakeup
from .stall_watch import StallWatch

# Whether this process has said that it found no GPU, and which warnings about the plan it gave:
# once is enough, a notebook that calls again knows them by then.
no_gpu_notice_shown = False
plan_warnings_shown: set[str] = set()
# The collectives torch's flight recorder keeps per process group in a watched call's ranks.
FLIGHT_RECORDER_ENTRIES = 256


def run(spec: CallSpec, paths: RunPaths, *, extra_env: Mapping[str, str], warm: bool = False,
        keep: KeptRanks | None = None, open_gpu_sample: Callable[[], Callable | None] | None = None,
        announce: bool = True, attempt: int = 0, on_stall_report: Callable | None = None,
        on_ranks_ended: Callable | None = None, survivors=None,
        on_node_health: Callable[[dict[int, list[dict]]], None] | None = None) -> list[object]:
    """Runs one attempt of the call in `paths`, its directory; returns the results in rank order
    (None for each rank of a script or native program) or raises the root cause.

    `extra_env` is set in every rank on top of the caller's environment (fanrun's own variables
    still win). `warm`: the ranks may be spares started ahead of the call (backends/local/spares.py).
    `keep`: the ranks may be the ones this holder kept from the last call, and this call's are
    kept there if it ends well (keep_alive). `open_gpu_sample()`, where a panel shows, gives what
    samples the ranks' GPUs for it. `announce`: the run's id is said as it starts (its first attempt).
    `on_stall_report(report, mux)`, where the call is watched for stalls, takes each stall's report;
    `on_ranks_ended(records, failure_seen_at)` then takes every rank's last progress record and
    when the first rank that failed was seen to end (None: none was), for the goodput ledger.
    `survivors`: where the call may restart, the ranks the last failed attempt kept in their
    processes (backends/local/survivors.py), and this attempt's, should it fail.
    `on_node_health(verdicts)`, on a cluster whose nodes' agents ran the health gate before the
    ranks started, takes each node's GPUs' verdicts."""
    plan = spec.plan
    global no_gpu_notice_shown
    if plan.notice and not no_gpu_notice_shown:
        no_gpu_notice_shown = True
        print(f"fanrun: {plan.notice}", file=sys.stderr, flush=True)
    if plan.warning and plan.warning not in plan_warnings_shown:
        plan_warnings_shown.add(plan.warning)
        print(f"fanrun: {plan.warning}", file=sys.stderr, flush=True)
    ranks: Ranks | None = None
    try:
        if spec.payload is not None:
            paths.write_payload(pickle.dumps({"sys_path": list(sys.path)}), spec.payload)
        logs = f"Logs: {paths.directory}"
        options = spec.options
        mux = OutputMux(plan.world_size, options.display, _where(plan), options.stall_warning,
                        open_gpu_sample=open_gpu_sample,
                        # The command first: a panel wrapped to its width keeps it on one row.
                        hints=(f"fanrun stacks {paths.run_id} (or fanrun.stacks() from another thread) shows "
                               f"every rank's stack without stopping it.\n{logs}", logs), run_dir=paths.directory,
                        title=f"run {paths.run_id}: {plan.description}")
        if announce and mux.panel is None:
            # The id that `fanrun stacks`, `list`, `logs` and `attach` take, said once as the run
            # starts, whatever the display: a panel has it as its title.
            print(f"fanrun: run {paths.run_id} started: {plan.description}; fanrun stacks {paths.run_id} shows "
                  f"every rank's stack", file=sys.stderr, flush=True)
        with SignalWakeup() as wakeup:
            # The first attempt unless extra_env says otherwise, whatever the caller's environment holds.
            first_attempt = {contract.ENV_RESTART_COUNT: "0", contract.ENV_MAX_RESTARTS: "0"}
            watched = on_stall_report is not None and spec.program.python
            launch = Launch(call=spec, paths=paths,
                            env={**os.environ, **first_attempt, **mux.rank_env, **(_progress_env() if watched else {}),
                                 **extra_env},
                            wakeup_fd=wakeup.read_fd, warm=warm, keep=keep, survivors=survivors,
                            added=frozenset(extra_env))
            ranks = backends.for_plan(plan).start(launch)
            if on_node_health is not None and ranks.gpu_verdicts:
                on_node_health(ranks.gpu_verdicts)
            mux.started()
            running_calls.add(paths, ranks, local=plan.backend == "local")
            timeout_report = TimeoutReport(python=spec.program.python)
            watch = StallWatch(paths, ranks, attempt, options.stall_timeout,
                               lambda report: on_stall_report(report, mux)) if watched else None
            try:
                _pump(ranks, mux, wakeup, timeout_report, watch)
            except BaseException:
                # Interrupted (Ctrl+C, a kernel interrupt), stopped for a stall, or broken: stop
                # every rank before the exception leaves, and keep relaying output meanwhile.
                ranks.cancel()
                try:
                    _pump(ranks, mux, wakeup, timeout_report)
                except BaseException:
                    ranks.kill_and_reap()  # a second interrupt: no more grace
                mux.finish(ended_well=False)
                raise
            finally:
                running_calls.remove(paths)
                mux.close()
                if watch is not None and on_ranks_ended is not None:
                    on_ranks_ended(watch.last_read(), watch.failure_seen_at)
        try:
            results = collect(spec.name, ranks, paths, mux, timeout_report, options.timeout,
                              returns_values=spec.returns_values)
        except BaseException as error:
            failed = ranks.first_failed_rank if ranks.stop_reason == _core.StopReason.RANK_FAILED else None
            mux.finish(False, failed, _last_lines(error))
            raise
        mux.finish(True)
        return results
    except Exception as error:
        if not plan.use_gpus:
            hints.note_gpu_call_on_cpu(error, plan.description)
        raise
    finally:
        if ranks is not None:
            ranks.close()
        paths.remove_bulky_files(plan.world_size)


def _progress_env() -> dict[str, str]:
    """What a watched call's ranks get: their progress record, and torch's flight recorder with a
    small buffer, unless the caller sized it."""
    env = {contract.ENV_PROGRESS: "1"}
    if not any(name in os.environ for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        env["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    return env


def _pump(ranks: Ranks, mux: OutputMux, wakeup: SignalWakeup, timeout_report: TimeoutReport,
          watch: StallWatch | None = None) -> None:
    # Every line of every rank is an event here: the kinds are looked up once.
    output, exited, timed_out = _core.EventKind.OUTPUT, _core.EventKind.RANK_EXITED, _core.EventKind.TIMED_OUT
    progress = _core.SegmentKind.PROGRESS
    while True:
        wait = mux.seconds_to_redraw()
        if watch is not None:
            wait = watch.seconds_to_check() if wait < 0 else min(wait, watch.seconds_to_check())
        events, interrupted, done = ranks.wait(wait, mux.gather_s)
        for event in events:
            kind = event.kind
            if kind is output:
                mux.write(event.rank, event.stream, event.segment, event.data)
                if watch is not None and event.segment is progress:
                    watch.beat(event.rank)
            elif kind is exited:
                mux.rank_exited(event.rank, event.exit_code, event.signal)
                if watch is not None:
                    watch.ended(event.rank, failed=event.exit_code != 0 or event.signal != 0)
            elif kind is timed_out:
                # The stack-dump signal is out and the ranks still run: from here, stderr is
                # kept, and what stands in the way of a dump can still be seen.
                timeout_report.start(ranks, mux)
        if watch is not None and not done:
            watch.check()
            mux.watched(*watch.shown())
        mux.flush()
        if interrupted:
            # Python's own handler runs as soon as this returns to the loop: a
            # KeyboardInterrupt is raised right here, between two waits.
            wakeup.drain()
        if done:
            return


def _where(plan) -> list[str]:
    """Each rank's node and device, as the panel names them."""
    per_node = max(plan.world_size // max(plan.nodes, 1), 1)
    device = "GPU {}" if plan.use_gpus else "CPU"
    return [(f"node {rank // per_node} " if plan.nodes > 1 else "") + device.format(rank % per_node)
            for rank in range(plan.world_size)]


def _last_lines(error: BaseException) -> list[str]:
    """What the panel shows of a failure: the end of the rank's traceback, or the message."""
    cause = error.__cause__
    text = str(cause) if isinstance(cause, RemoteTraceback) else str(error)
    # Lines end at newlines only: splitlines() would also end one at a C1 or other control that
    # the rank's message holds, which the panel then leaves out.
    return text.strip().split("\n")
