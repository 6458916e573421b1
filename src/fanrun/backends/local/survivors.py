"""The ranks of a failed attempt that wait for the next one in their processes (restarts that
keep the processes): each at its rank, the others None (the rank whose failure started it, and
any that ended). The caller's call path holds one per call that may restart (_launch/call.py);
LocalRanks fills it as an attempt fails, and the next attempt's ranks become them."""

from __future__ import annotations


class Survivors:
    def __init__(self) -> None:
        self._ranks: list = []  # a SpareRank or None for each rank
        # Whether an attempt follows this one if it fails: only then do its ranks survive a failure.
        self.another_follows = True

    def keep(self, ranks: list) -> None:
        self._ranks = list(ranks)

    def ranks(self) -> list[int]:
        """The ranks that survived the last failure."""
        return [rank for rank, spare in enumerate(self._ranks) if spare is not None]

    def pids(self) -> list[int]:
        """The processes of the ranks that survived the last failure and still wait."""
        return [spare.pid for spare in self._ranks if spare is not None and spare.waiting()]

    def take(self, world_size: int) -> list:
        """Each rank's survivor still waiting, or None; all None for a call of another size."""
        ranks, self._ranks = self._ranks, []
        if len(ranks) != world_size:
            return [None] * world_size
        return [spare if spare is not None and spare.waiting() else None for spare in ranks]

    def drop(self) -> None:
        """They end with their keepers: the call is over."""
        self._ranks = []
