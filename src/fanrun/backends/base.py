"""The interface between the launcher and a backend: what a backend is given to start a call's
ranks (Launch), and what it hands back to follow and stop them (Ranks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from .. import _core
from .._accelerators import Plan
from .._spec.paths import RunPaths
from .._spec.program import RankProgram
from .local.spares import KeptRanks

# From SIGTERM to SIGKILL when the run stops early.
KILL_GRACE_S = 5.0

# How long ranks get to write their stacks at a timeout before they are stopped.
STACK_DUMP_WAIT_S = 1.0


# An event: (kind, rank, stream, segment, bytes, (exit code, signal)), as the engine reports it.
Event = tuple[_core.EventKind, int, int, _core.SegmentKind, bytes, tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One call, as every backend gets it."""

    program: RankProgram
    paths: RunPaths  # the run's files: logs, payload, results, error files
    env: Mapping[str, str]  # the caller's environment, with what the call adds (tracking)
    timeout: float | None
    expect_done: bool  # a function's ranks report "done" once their result is written
    wakeup_fd: int  # a descriptor that a signal makes readable: wait() then returns "interrupted"
    warm: bool = False  # ranks may be spare ones, started ahead (backends/local/spares.py), where the backend has them
    # keep_alive: the ranks the function's last call kept, and where this call's ranks are kept
    # once it ends well (backends/local/spares.py).
    keep: KeptRanks | None = None
    # The variables of `env` that the call sets itself (a workload's env_variables, tracking's):
    # a cluster's ranks get them whatever their names.
    added: frozenset[str] = frozenset()


class Ranks(Protocol):
    """A call's ranks once started: their events, their end, and how they ended."""

    world_size: int
    stop_reason: _core.StopReason
    first_failed_rank: int
    ranks_running_at_timeout: list[int]
    # An end of the backend's own that no rank reports (a node lost): raised as the run's outcome.
    failure: BaseException | None

    def wait(self, max_wait_s: float = -1.0, gather_s: float = 0.0) -> tuple[list[Event], bool, bool]:
        """(events, interrupted, done): waits at most max_wait_s (no limit below 0). Output may be
        held back for gather_s after its first piece, to come in one batch; a backend may report
        it sooner, and reports any other event at once."""

    def cancel(self) -> None:
        """Stops every rank: SIGTERM, then SIGKILL after the grace period."""

    def kill_and_reap(self) -> None:
        """Kills every rank now and waits for them."""

    def pid(self, rank: int) -> int: ...

    def location(self, rank: int) -> str:
        """Where the rank runs, for messages: "pid 123", with its node where there are several."""

    def stack_dump_obstacle(self, rank: int) -> str | None:
        """At a timeout, while the rank still runs: why it cannot dump its stack, if /proc says."""

    def exit_status(self, rank: int) -> tuple[int, int] | None: ...

    def close(self) -> None:
        """Releases what the ranks no longer need (a rendezvous); called once, at the end."""


class Backend(Protocol):
    name: str

    def start(self, plan: Plan, launch: Launch) -> Ranks: ...
