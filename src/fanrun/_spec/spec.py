"""A call as data. Every door (the decorator, `fanrun run`, `fanrun submit`, TorchDistributor, a
detached run's runner) builds one CallSpec and hands it to the one call path (_launch/call.py);
each attempt of it reaches a backend as a Launch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._accelerators import AcceleratorRequest, Inventory, Plan
from .paths import RunPaths
from .program import RankProgram

DEFAULT_TIMEOUT_S = 3 * 60 * 60
# A panel flags a rank with no output, progress or metric for this long.
DEFAULT_STALL_WARNING_S = 300.0
# How the ranks' output shows: one live panel, every line labelled by rank, or nothing (the run's
# log files keep it all). None: the panel in a notebook, logs elsewhere.
DISPLAYS = ("panel", "logs", "quiet")
# How a restart (max_restarts) treats the ranks that did not fail: "keep" calls the function again
# in their processes, "fresh" starts every rank in a new one.
RESTARTS = ("keep", "fresh")


@dataclasses.dataclass(frozen=True)
class Options:
    """What the caller asked for, checked by the door it came through."""

    num_accelerators: int | None
    accelerator: AcceleratorRequest | None
    timeout: float | None
    # How the caller asked for GPUs, where a CPU process will not do: what it wrote ("gpus=2",
    # "use_gpu=True") and what to write instead for CPU processes. None: CPU processes where
    # there is no GPU.
    gpus_required: tuple[str, str] | None = None
    experiment_name: str | None = None
    run_id: str | None = None
    tracking: bool = True
    # Neither a run nor MLflow variables: the ranks' MLflow is the caller's, as configured (what
    # Spark's TorchDistributor and torchrun do).
    leave_mlflow_alone: bool = False
    # Machines (None: this one), where the ranks run (None: Ray when connected and nodes is
    # given, else this machine), and how long a cluster may take to fit the call.
    nodes: int | None = None
    backend: str | None = None
    placement_timeout: float = 60.0
    # srun's options for backend="slurm" (backends/slurm/allocation.py), checked.
    slurm: dict[str, str] | None = None
    # Ranks from spares started ahead (backends/local/spares.py): None follows FANRUN_WARM, fanrun.warmup(), then the machine's cores.
    warm: bool | None = None
    # The ranks stay alive between the calls of the function (backends/local/spares.py, KeptRanks).
    keep_alive: bool = False
    # The call goes on in a process of its own (_detached/), and its door returns a fanrun.Run at once.
    detach: bool = False
    # A failed attempt starts again, this many times at most: in the processes of the ranks that
    # did not fail ("keep"), or with every rank in a new one ("fresh"); RESTARTS.
    max_restarts: int = 0
    restart: str = "keep"
    # The MLflow run's name (a workload's mlflow_run_name); None: the function's name and a random part.
    run_name: str | None = None
    # How the ranks' output shows (DISPLAYS); the panel flags a rank quiet for stall_warning seconds.
    display: str | None = None
    stall_warning: float | None = DEFAULT_STALL_WARNING_S
    # A call with no progress for stall_timeout seconds (None: tied to its step time) is reported
    # (_launch/stall_watch.py): "report", "abort", a callable given the report, or None (not watched).
    stall_timeout: float | None = None
    on_stall: Any = "report"
    # The GPUs' health, checked once their locks are held and before any rank starts (_health/):
    # "cheap", "deep" or "off"; exclude_unhealthy: run on the healthy ones, re-ranked, instead of failing.
    health: str = "cheap"
    exclude_unhealthy: bool = False


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """One call: what runs on every rank, where, and as the caller asked. Built by
    _launch/call.py's plan(), which checks it against the machine before anything starts."""

    name: str  # the function's, script's or program's: in the run's id, its MLflow run, its messages
    options: Options
    plan: Plan
    program: RankProgram
    # This machine's GPUs, where the plan uses them: their locks, the panel's and tracking's samples.
    inventory: Inventory | None = None
    # The pickled (function, args, kwargs), for RankProgram.function(); None for a script or program.
    payload: bytes | None = None
    # Added to every rank's environment (a workload's env_variables).
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def returns_values(self) -> bool:
        """A function's ranks each send back a value; a script's or a program's do not."""
        return self.payload is not None

    def gpus(self) -> tuple:
        """The GPUs this machine gives the ranks, in rank order (a cluster's are its nodes' own)."""
        if self.inventory is None or not self.plan.use_gpus:
            return ()
        return tuple(self.inventory.visible[: self.plan.world_size])


@dataclasses.dataclass(frozen=True)
class Launch:
    """One attempt of a call, as every backend gets it."""

    call: CallSpec
    paths: RunPaths  # the attempt's files: logs, payload, results, error files
    env: Mapping[str, str]  # the caller's environment, with what the call adds (tracking, restarts)
    wakeup_fd: int  # a descriptor that a signal makes readable: wait() then returns "interrupted"
    warm: bool = False  # ranks may be spare ones, started ahead, where the backend has them
    # keep_alive: the ranks the function's last call kept, and where this call's ranks are kept
    # once it ends well (backends/local/spares.py's KeptRanks, which only that backend reads).
    keep: Any = None
    # A call that may restart: the ranks of the last failed attempt that survived it, and where
    # this attempt's survivors go if it fails (backends/local/survivors.py, which only that backend reads).
    survivors: Any = None
    # The variables of `env` that the call sets itself (a workload's env_variables, tracking's):
    # a cluster's ranks get them whatever their names.
    added: frozenset[str] = frozenset()

    @property
    def plan(self) -> Plan:
        return self.call.plan

    @property
    def program(self) -> RankProgram:
        return self.call.program

    @property
    def timeout(self) -> float | None:
        return self.call.options.timeout

    @property
    def expect_done(self) -> bool:
        """A function's ranks report "done" once their result is written: one that ends without it has failed."""
        return self.call.returns_values
