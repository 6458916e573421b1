"""The interface between the launcher and a backend: a backend is given one attempt of a call
(_spec's Launch) and hands back its ranks (Ranks), to follow through their events and stop."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from .. import _core
from .._spec.spec import Launch
from .rank_evidence import RankAnswer

# From SIGTERM to SIGKILL when the run stops early.
KILL_GRACE_S = 5.0

# How long ranks get to write their stacks at a timeout before they are stopped.
STACK_DUMP_WAIT_S = 1.0

# After the first failure, how long the other ranks get to say what they were doing (their flight
# recorder's collectives) before they are stopped; one that answers at all does so in milliseconds.
FAILURE_EVIDENCE_S = 1.0


# What a backend's ranks report, whichever backend: the engine's own events (its kind, rank,
# stream, segment, data, exit_code and signal), ranks numbered among the whole run's.
Event = _core.Event


class Ranks(Protocol):
    """A call's ranks once started: their events, their end, and how they ended."""

    world_size: int
    stop_reason: _core.StopReason
    first_failed_rank: int
    ranks_running_at_timeout: list[int]
    # An end of the backend's own that no rank reports (a node lost): raised as the run's outcome.
    failure: BaseException | None
    # On a cluster, by node: its GPUs' verdicts from the health gate its agent ran before any rank
    # started ({"index", "uuid", "name", "problems"}, none where healthy); empty elsewhere.
    gpu_verdicts: dict[int, list[dict]]
    # The ranks asked for their collectives when the first failure came, before they were
    # stopped: rank -> when (time.time() on the machine where it runs); empty where none was.
    failure_evidence: dict[int, float]

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

    def ask_for_evidence(self, ended: Collection[int]) -> dict[int, RankAnswer]:
        """A stall's evidence, asked of every rank not in `ended` without stopping it, where it runs:
        each rank's answer (rank_evidence.py), those of ended ranks with their last lines alone,
        and for one that could not be asked (its node gave nothing in time), why."""

    def ask_for_collectives(self, ended: Collection[int]) -> None:
        """Asks every rank not in `ended` for its flight recorder's collectives, without waiting:
        their answers come into the call's run directory (rank_evidence.collectives), written
        there by the ranks, or on a cluster by each node's agent, which asks its own ranks."""

    def close(self) -> None:
        """Releases what the ranks no longer need (a rendezvous); called once, at the end."""


class Backend(Protocol):
    name: str

    def start(self, launch: Launch) -> Ranks: ...
