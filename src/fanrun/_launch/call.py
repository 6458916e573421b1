"""The one call path. Every door builds a CallSpec with plan() and hands it to run(), which drives
the call to its end: its record (records.py), the GPUs' locks, tracking (_tracking/hook.py), each
attempt's run directory and ranks (run.py), the restarts (max_restarts), and the outcome. A detached run's runner
(_detached/runner.py) and a workload's Ray job (_detached/ray_driver.py) call run() too. Its goodput
ledger (goodput.py) follows the attempts and ends in the call's MLflow run, its record and one line."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping

from .. import _accelerators
from .._errors import GpuHealthError
from .._health import check as health
from .._rank import contract
from .._spec.paths import RunPaths
from .._spec.program import RankProgram
from .._spec.spec import CallSpec, Options
from .._tracking import hook as tracking
from ..backends.local import KEEPER, spares
from ..backends.local.survivors import Survivors
from ..backends.rank_env import RANK_DEFAULTS
from . import goodput, gpu_locks, records, run as attempt_run, stall_outcome
from .preflight import preflight


def plan(name: str, options: Options, program: RankProgram, *, payload: bytes | None = None,
         env: Mapping[str, str] | None = None) -> CallSpec:
    """The call, checked against the machine (or the cluster) once, and what would stop it halfway
    found (preflight.py): every mistake so far is an exception, and nothing has started."""
    inventory = None
    if _backend_for(options) == "ray":
        from ..backends import ray as ray_backend

        if options.keep_alive:
            raise ValueError("keep_alive=True keeps the ranks of this machine alive between calls; a call through "
                             "Ray starts its ranks afresh: drop keep_alive=True, or call without Ray")
        call_plan = ray_backend.plan(options.num_accelerators, options.accelerator, options.nodes or 1,
                                     options.placement_timeout)
    elif _backend_for(options) == "slurm":
        from ..backends import slurm as slurm_backend

        if options.keep_alive:
            raise ValueError("keep_alive=True keeps the ranks of this machine alive between calls; a call through "
                             "Slurm starts its ranks afresh: drop keep_alive=True, or call without Slurm")
        call_plan = slurm_backend.plan(options.num_accelerators, options.accelerator, options.nodes or 1,
                                       options.slurm or {})
    else:
        inventory = _accelerators.detect()
        call_plan = _accelerators.plan_run(options.num_accelerators, options.accelerator, inventory,
                                           gpus_required=options.gpus_required)
    if call_plan.backend != "local" and call_plan.use_gpus:
        _check_node_health_options(options, call_plan.backend)
    preflight(call_plan)
    return CallSpec(name=name, options=options, plan=call_plan, program=program, inventory=inventory,
                    payload=payload, env=dict(env or {}))


def run(spec: CallSpec, *, kept: spares.KeptRanks | None = None, record: records.RunRecord | None = None) -> list:
    """Runs the call on every rank of its plan; returns the ranks' values in rank order (None for
    each rank of a script or program) or raises the root cause. A failed attempt starts every
    rank again, up to max_restarts times. `kept`: the ranks a keep_alive function keeps between
    calls. `record`: the run's record, where its door made it (a detached run's runner, which
    ends it); else the call makes one (records.py), which ends with it."""
    ledger = goodput.Ledger()
    options = spec.options
    warm = spares.warm(options.warm, spec.plan.world_size, repeatable=spec.program.is_function and record is None)
    restarts_warm = options.max_restarts > 0 and spec.plan.backend == "local" and spec.program.python
    if restarts_warm:
        # A restart takes spares whose imports are done: they start now, while the first attempt runs.
        spares.POOL.fill_soon(spec.plan.world_size, KEEPER, RANK_DEFAULTS)
    # The ranks a failed attempt keeps in their processes for the next (restarts that keep the processes).
    survivors = Survivors() if restarts_warm and options.restart == "keep" else None
    try:
        # The run's record, from here to its end: the one place where a blocking call's ends.
        with records.of_call(spec.name, spec.plan.world_size, record) as record:
            try:
                with tracking.call(spec) as submission:
                    tracking.holds_ledger(submission, ledger)
                    for attempt in range(options.max_restarts + 1):
                        ledger.attempt_started()
                        try:
                            if survivors is not None:
                                survivors.another_follows = attempt < options.max_restarts
                            results = _attempt(spec, attempt, submission, kept, record, ledger,
                                               warm=warm or (restarts_warm and attempt > 0), survivors=survivors)
                            ledger.attempt_ended()
                            return results
                        except GpuHealthError:
                            ledger.attempt_failed()
                            raise  # the GPU is as unhealthy for the next attempt: nothing to retry
                        except Exception as error:  # an interrupt is never retried
                            ledger.attempt_failed()
                            if attempt == options.max_restarts:
                                raise
                            first_line = (str(error).splitlines() or [""])[0]
                            _say(f"attempt {attempt + 1} of {options.max_restarts + 1} failed ({type(error).__name__}: "
                                 f"{first_line}); {_restart_plan(survivors, spec.plan.world_size)}")
                    raise AssertionError("unreachable")
            finally:
                goodput.report(ledger.close(), record, _say)
    finally:
        if survivors is not None:
            survivors.drop()
        if restarts_warm and not warm:
            spares.POOL.drop()  # started for restarts alone: they do not outlive the call


def _attempt(spec: CallSpec, attempt: int, submission, kept: spares.KeptRanks | None,
             record: records.RunRecord, ledger: goodput.Ledger, *, warm: bool, survivors: Survivors | None) -> list:
    # The GPUs are this call's alone while it runs: a call that holds them already goes first.
    gpus = spec.gpus()
    with gpu_locks.hold(gpus, holder=repr(spec.name), on_busy=_say):
        # Before any rank starts: an unhealthy GPU stops the call, or is left out (exclude_unhealthy).
        gate = _health_gate(spec, survivors.pids() if survivors is not None else ())
        spec = gate.checked_spec()
        ledger.locks_held()
        # The MLflow run starts once the GPUs are free, and ends with the call's outcome.
        gpu_indices = [gpu.nvml_index for gpu in spec.gpus()]
        with tracking.attempt(spec, submission, gpu_indices, gate.record()) as tracked:
            if submission is None:
                tracking.holds_ledger(tracked, ledger)  # the attempt's run is the call's
            # One run directory, for the launcher and for tracking, which uploads its logs.
            with RunPaths.create(spec.name, run_id=record.id) as paths:
                tracked.use_directory(paths)
                record.attempt(paths.directory)
                restarts = {contract.ENV_RESTART_COUNT: str(attempt),
                            contract.ENV_MAX_RESTARTS: str(spec.options.max_restarts)}
                return attempt_run.run(spec, paths, extra_env={**spec.env, **tracked.rank_env, **restarts},
                                       warm=warm, keep=kept, open_gpu_sample=tracking.gpu_sampler(gpu_indices),
                                       announce=attempt == 0, attempt=attempt,
                                       on_stall_report=stall_outcome.handler(spec.options.on_stall, paths, record),
                                       on_ranks_ended=ledger.ranks_ended, survivors=survivors,
                                       on_node_health=lambda verdicts: tracking.node_health(
                                           tracked, health.node_record(spec.options.health, verdicts)))


def _check_node_health_options(options: Options, backend: str) -> None:
    """What the health gate cannot do on a cluster's nodes, where each node's agent runs the cheap
    check before any rank starts: refused before anything starts, not ignored."""
    where = "a Ray cluster's" if backend == "ray" else "a Slurm allocation's"
    if options.health == "deep":
        raise ValueError(f"health='deep' runs its work on this machine's GPUs, not on {where} nodes, which the cheap "
                         f"check covers before any rank starts: pass health='cheap', or run `fanrun doctor --deep` "
                         f"on each node")
    if options.exclude_unhealthy:
        raise ValueError(f"exclude_unhealthy=True re-ranks one machine's healthy GPUs; a call over {where} nodes "
                         f"needs as many on each: drop it, and leave an unhealthy node out of the call instead")


def _restart_plan(survivors: Survivors | None, world_size: int) -> str:
    kept = survivors.ranks() if survivors is not None else []
    if not kept:
        return "starting every rank again"
    replaced = [rank for rank in range(world_size) if rank not in kept]
    return (f"keeping {_ranks_named(kept)} in {'its process' if len(kept) == 1 else 'their processes'}, "
            f"starting {_ranks_named(replaced)} again")


def _ranks_named(ranks: list[int]) -> str:
    names = ", ".join(map(str, ranks))
    return f"rank {names}" if len(ranks) == 1 else f"ranks {names}"


def check_health(spec: CallSpec) -> health.Gate:
    """The health gate alone, on the GPUs of `spec`, with their locks held (`fanrun doctor`)."""
    with gpu_locks.hold(spec.gpus(), holder=repr(spec.name), on_busy=_say):
        return _health_gate(spec)


def _health_gate(spec: CallSpec, own_ranks: Iterable[int] = ()) -> health.Gate:
    gate = health.Gate(spec, own_ranks)
    # health="deep": a short call of work on each GPU, on the GPUs whose locks this call holds.
    gate.run_deep(_run_on_held_gpus)
    return gate


def _run_on_held_gpus(spec: CallSpec) -> list:
    with RunPaths.create(spec.name) as paths:
        return attempt_run.run(spec, paths, extra_env=dict(spec.env), announce=False)


def _say(text: str) -> None:
    print(f"fanrun: {text}", file=sys.stderr, flush=True)


def _backend_for(options: Options) -> str:
    """Where this call runs: the backend asked for; else, with nodes given, Ray when connected, or
    Slurm inside an allocation; else here."""
    from ..backends.ray.connect import is_connected
    from ..backends.slurm.allocation import in_allocation

    if options.backend is not None:
        return options.backend
    if options.nodes is None:
        return "local"
    if is_connected():
        return "ray"
    if options.nodes == 1:
        return "local"
    if in_allocation():
        return "slurm"
    raise ValueError(
        f"nodes={options.nodes} spreads the ranks over {options.nodes} machines, of a Ray cluster or a Slurm "
        f"allocation, and this process has neither: call fanrun.ray_init() first (or pass backend='ray', which "
        f"does), or pass backend='slurm' (srun asks Slurm for the nodes) or call from inside an allocation"
    )
