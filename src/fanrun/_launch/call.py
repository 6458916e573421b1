"""One call, driven to its end: the plan, the GPUs' locks, the MLflow runs (one per attempt,
nested under the call's own when it may restart), each attempt's run directory, the ranks, and
the restarts (max_restarts). The decorator (_decorator.py) and a detached run's runner
(_detached/runner.py) both call through here."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

from .. import _accelerators
from . import gpu_locks, run
from .._spec import program
from ..backends.local import spares
from .._spec.paths import RunPaths
from .._rank import contract
from .._tracking import caller as call_tracking
from .._tracking import system_metrics
from ..backends.local import backend as local_backend
from ..backends.rank_env import RANK_DEFAULTS

if TYPE_CHECKING:
    from .._decorator import Options


def plan_for(options: Options) -> tuple[_accelerators.Plan, _accelerators.Inventory | None]:
    """The call's plan, checked against the machine (or the cluster), and this machine's inventory."""
    if _backend_for(options) == "ray":
        from ..backends import ray as ray_backend

        if options.keep_alive:
            raise ValueError("keep_alive=True keeps the ranks of this machine alive between calls; a call through "
                             "Ray starts its ranks afresh: drop keep_alive=True, or call without Ray")
        plan = ray_backend.plan(options.num_accelerators, options.accelerator, options.nodes or 1, options.placement_timeout)
        return plan, None
    inventory = _accelerators.detect()
    plan = _accelerators.plan_run(options.num_accelerators, options.accelerator, inventory, gpus_asked=options.gpus_asked)
    return plan, inventory


def run_call(payload: bytes | None, name: str, options: Options, plan: _accelerators.Plan,
             inventory: _accelerators.Inventory | None, *, rank_program: program.RankProgram | None = None,
             env: Mapping[str, str] | None = None, kept: spares.KeptRanks | None = None,
             on_paths: Callable[[RunPaths], None] | None = None) -> list:
    """Runs a serialized call (or, without one, `rank_program`: a script, a module, a program) on
    every rank of `plan`, tracked as `options` say, with `env` added to the ranks' environment;
    returns the ranks' values or raises the root cause. A failed attempt starts every rank again,
    up to options.max_restarts times. `on_paths` learns each attempt's run directory."""
    call = _Call(payload, rank_program or program.RankProgram.function(), name, dict(env or {}), kept, on_paths)
    warm = spares.warm(options.warm)
    restarts_warm = options.max_restarts > 0 and plan.backend == "local" and call.rank_program.python
    if restarts_warm:
        # A restart takes spares whose imports are done: they start now, while the first attempt runs.
        spares.POOL.fill_soon(plan.world_size, local_backend.KEEPER, RANK_DEFAULTS)
    try:
        with call_tracking.track_submission(function_name=name, plan=plan, options=options) as submission:
            for attempt in range(options.max_restarts + 1):
                try:
                    return _attempt(call, options, plan, inventory, attempt, submission,
                                    warm=warm or (restarts_warm and attempt > 0))
                except Exception as error:  # an interrupt is never retried
                    if attempt == options.max_restarts:
                        raise
                    first_line = (str(error).splitlines() or [""])[0]
                    print(f"fanrun: attempt {attempt + 1} of {options.max_restarts + 1} failed ({type(error).__name__}: "
                          f"{first_line}); starting every rank again", file=sys.stderr, flush=True)
            raise AssertionError("unreachable")
    finally:
        if restarts_warm and not warm:
            spares.POOL.drop()  # started for restarts alone: they do not outlive the call


@dataclasses.dataclass(frozen=True)
class _Call:
    payload: bytes | None
    rank_program: program.RankProgram
    name: str
    env: dict[str, str]
    kept: spares.KeptRanks | None
    on_paths: Callable[[RunPaths], None] | None


def _attempt(call: _Call, options: Options, plan: _accelerators.Plan, inventory: _accelerators.Inventory | None,
             attempt: int, submission: call_tracking.Submission | None, *, warm: bool) -> list:
    # The GPUs the ranks get, in rank order: the ones the run's system metrics describe. (A
    # cluster's GPUs are the nodes' own: this machine samples none of them.) They are this call's
    # alone while it runs: a call that holds them already goes first.
    gpus = inventory.visible[: plan.world_size] if inventory and plan.use_gpus else ()
    with gpu_locks.hold(gpus, holder=repr(call.name), on_busy=_say):
        # The MLflow run starts once the GPUs are free, and ends with the call's outcome.
        gpu_indices = [gpu.nvml_index for gpu in gpus]
        with call_tracking.track(function_name=call.name, plan=plan, gpu_indices=gpu_indices, options=options,
                                 submission=submission) as tracked:
            # One run directory, for the launcher and for tracking, which uploads its logs.
            with RunPaths.create(call.name) as paths:
                tracked.paths = paths
                if call.on_paths is not None:
                    call.on_paths(paths)
                restarts = {contract.ENV_RESTART_COUNT: str(attempt), contract.ENV_MAX_RESTARTS: str(options.max_restarts)}
                return run.run(
                    name=call.name,
                    plan=plan,
                    program=call.rank_program,
                    timeout=options.timeout,
                    payload=call.payload,
                    extra_env={**call.env, **tracked.rank_env, **restarts},
                    paths=paths,
                    warm=warm,
                    keep=call.kept,
                    display=options.display,
                    stall_warning=options.stall_warning,
                    open_gpu_sample=functools.partial(_open_gpu_sample, gpu_indices) if gpu_indices else None,
                )


def _open_gpu_sample(nvml_indices: list[int]):
    """What the live panel shows of each rank's GPU: NVML's utilisation and memory, sampled in this
    process; None without NVML. Opened only where a panel shows."""
    reader = system_metrics.GpuReader.open(nvml_indices)
    return reader.per_gpu if reader is not None else None


def _say(text: str) -> None:
    print(f"fanrun: {text}", file=sys.stderr, flush=True)


def _backend_for(options: Options) -> str:
    """Where this call runs: Ray when asked, or when connected and nodes is given; else here."""
    from ..backends.ray.connect import is_connected

    if options.backend is not None:
        return options.backend
    if options.nodes is None:
        return "local"
    if is_connected():
        return "ray"
    if options.nodes == 1:
        return "local"
    raise ValueError(
        f"nodes={options.nodes} spreads the ranks over {options.nodes} machines of a Ray cluster, and this "
        f"process is connected to none: call fanrun.ray_init() first (or pass backend='ray', which does)"
    )
