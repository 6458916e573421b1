"""Stragglers among the ranks of a running call: a rank whose own time per step stays well above
the others', and why (its data, its compute, its collectives), from successive reads of their
progress records and, where torch keeps one, of their flight recorders.

A rank's own time is its step less its time in collectives: in lockstep training every rank's
step lasts as long as the slowest one's, the others waiting for it in a collective, so the step
alone would blame no one. Under DDP the gradient all-reduces are no Python call of
torch.distributed, so even that difference is hidden; there the flight recorder tells who
starts each collective last, and so how long each other rank waits for it in every step."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from .._spec.progress_record import comm_per_step_s
from .stall_report import RankProgress

# Flagged: over MARGIN times the others' median, for STEPS consecutive steps in a row.
MARGIN = 1.5
STEPS = 5

# A group's collectives since the last read: how many it started (by their seqs), and for each one
# that every rank has started, its seq and when each rank created it (ns).
_Started = tuple[int, list[tuple[int, dict[int, int]]]]


@dataclasses.dataclass(frozen=True)
class Straggler:
    rank: int
    reason: str  # "data", "compute" or "communication"
    # Its step's own time over the others' median; for "communication", its time in collectives
    # over theirs.
    ratio: float
    steps: int  # how many consecutive steps it was flagged


@dataclasses.dataclass(frozen=True)
class _Streak:
    kind: str  # "own" (data or compute), "communication" or "late": a change of kind starts over
    reason: str
    ratio: float
    count: int


class StragglerWatch:
    """Fed each read of every rank's progress record (update()) and, optionally, of their flight
    recorders (update_collectives()); tells which ranks straggle, and gives the live panel its words."""

    def __init__(self, margin: float = MARGIN, steps: int = STEPS) -> None:
        self._margin = margin
        self._steps = steps
        self._latest: dict[int, RankProgress] = {}
        self._streaks: dict[int, _Streak] = {}  # from the steps
        self._late: dict[int, _Streak] = {}  # from the flight recorders
        self._seen_seq: dict[str, int] = {}  # per group, the last seq judged
        # From the flight recorders: each rank's wait per step for the last rank to start its
        # collectives, and each rank's steps when they were last read.
        self._collective_wait_s: dict[int, float] = {}
        self._steps_at_collectives: dict[int, int] = {}

    def update(self, snapshots: Sequence[RankProgress | None], now: float) -> list[Straggler]:
        """Takes a read of every rank's record (None: not read this time), made at `now`, and
        gives the stragglers. A rank with new steps since the last read counts once, however
        many steps it made: the record holds the last step's times alone. (The rules count
        steps, not time: `now` is taken for the stall watch's reads to keep one shape.)"""
        fresh = []
        for snapshot in snapshots:
            if snapshot is None:
                continue
            before = self._latest.get(snapshot.rank)
            if snapshot.step_s > 0 and (before is None or snapshot.steps > before.steps):
                fresh.append(snapshot.rank)
            self._latest[snapshot.rank] = snapshot
        judged = {rank: self._judge(rank) for rank in self._measured()}
        # Where a rank is slow in its own time, the others' longer collectives are their waits for it.
        someone_slow = any(judgement and judgement[0] != "communication" for judgement in judged.values())
        for rank in fresh:
            judgement = judged[rank]
            if judgement is None or (judgement[0] == "communication" and someone_slow):
                self._streaks.pop(rank, None)
                continue
            reason, ratio = judgement
            kind = "communication" if reason == "communication" else "own"
            self._streaks[rank] = _Streak(kind, reason, ratio, self._next_count(self._streaks, rank, kind))
        return self.stragglers()

    def update_collectives(self, entries_by_rank: Mapping[int, Sequence[dict]]) -> list[Straggler]:
        """Takes each rank's last flight-recorder entries (dicts of seq, op, state, created_ns and
        group) and gives the stragglers. For each collective that every rank of its group has
        started since the last call, the rank that started it last, and how much after the
        first; a rank that is last in most of them, late by more than the margin allows, counts
        once per call."""
        by_group = self._created(entries_by_rank)
        self._estimate_waits(by_group)
        created = [by_rank for _, collectives in by_group.values() for _, by_rank in collectives]
        if not created:
            return self.stragglers()
        last = [max(by_rank, key=by_rank.get) for by_rank in created]
        candidate = max(set(last), key=last.count)
        snapshot = self._latest.get(candidate)
        if last.count(candidate) * 2 <= len(last) or snapshot is None or snapshot.step_s <= 0:
            self._late.clear()
            return self.stragglers()
        late_s = max((max(by_rank.values()) - min(by_rank.values())) / 1e9
                     for by_rank, rank in zip(created, last) if rank == candidate)
        # Its peers wait for it inside their steps: their own time is its step less its lateness.
        step = snapshot.step_s
        ratio = step / (step - late_s) if step > late_s else math.inf
        if ratio <= self._margin:
            self._late.clear()
            return self.stragglers()
        others_data = [p.step_data_s for rank, p in self._measured().items() if rank != candidate]
        data_excess = snapshot.step_data_s - (statistics.median(others_data) if others_data else 0.0)
        reason = "data" if data_excess > late_s / 2 else "compute"
        count = self._next_count(self._late, candidate, "late")
        self._late = {candidate: _Streak("late", reason, ratio, count)}
        return self.stragglers()

    def stragglers(self) -> list[Straggler]:
        """The ranks flagged for long enough, by their steps where they are, else by their lateness."""
        flagged = {}
        for streaks in (self._late, self._streaks):
            for rank, streak in streaks.items():
                if streak.count >= self._steps:
                    flagged[rank] = Straggler(rank, streak.reason, streak.ratio, streak.count)
        return [flagged[rank] for rank in sorted(flagged)]

    def metrics(self, rank: int) -> dict[str, float]:
        """The rank's last step: its time, and the fractions of it spent waiting for data and in
        collectives; {} before its second step."""
        snapshot = self._measured().get(rank)
        if snapshot is None:
            return {}
        return {"step_time_s": snapshot.step_s, "data_wait_fraction": _fraction(snapshot.step_data_s, snapshot.step_s),
                "comm_wait_fraction": _fraction(self._comm_s(snapshot), snapshot.step_s)}

    def collective_waits(self) -> dict[int, float]:
        """Each rank's wait per step in collectives as its flight recorder tells it (seconds), for
        the ranks it was told of: the share of a step that no Python collective shows (DDP)."""
        return dict(self._collective_wait_s)

    def row_words(self, rank: int) -> str:
        """The live panel's words for a rank: `step 0.21 s · data 5% · comm 40%`; "" before its second step."""
        metrics = self.metrics(rank)
        if not metrics:
            return ""
        return (f"step {_seconds(metrics['step_time_s'])} · data {metrics['data_wait_fraction']:.0%} · "
                f"comm {metrics['comm_wait_fraction']:.0%}")

    def _measured(self) -> dict[int, RankProgress]:
        """The ranks that have a last step's times: two steps or more."""
        return {rank: p for rank, p in self._latest.items() if p.step_s > 0}

    def _judge(self, rank: int) -> tuple[str, float] | None:
        """(reason, ratio) where the rank's last step is over the margin against the others' median."""
        measured = self._measured()
        me, others = measured[rank], [p for other, p in measured.items() if other != rank]
        if not others:
            return None
        own, others_own = me.step_s - self._comm_s(me), statistics.median(p.step_s - self._comm_s(p) for p in others)
        if others_own > 0 and own > self._margin * others_own:
            data_excess = me.step_data_s - statistics.median(p.step_data_s for p in others)
            return ("data" if data_excess > (own - others_own) / 2 else "compute"), own / others_own
        others_comm = statistics.median(self._comm_s(p) for p in others)
        if others_comm > 0 and self._comm_s(me) > self._margin * others_comm:
            return "communication", self._comm_s(me) / others_comm
        return None

    def _comm_s(self, progress: RankProgress) -> float:
        return comm_per_step_s(progress, self._collective_wait_s.get(progress.rank, 0.0))

    def _estimate_waits(self, by_group: Mapping[str, _Started]) -> None:
        """Each rank's wait per step, from the collectives started by every rank since the last read.
        Each step starts the same number of collectives (DDP's gradient buckets), and a rank that
        waits for a later one falls further behind it at each of its step's collectives, to wait
        at the step's end for the last one: in every run of a step's worth of collectives, the
        largest lateness is that wait. The recorder holds the last few hundred collectives: at
        many steps a second, some of them are gone by the next read, and the runs seen stand for
        the rest."""
        if not any(collectives for _, collectives in by_group.values()):
            return  # the steps since the last read are counted with the collectives that come next
        steps = {rank: p.steps for rank, p in self._latest.items()}
        before, self._steps_at_collectives = self._steps_at_collectives, steps
        advanced = min((steps[rank] - before[rank] for rank in steps if rank in before), default=0)
        if advanced <= 0:
            return
        waited: dict[int, float] = {}
        for issued, collectives in by_group.values():
            if not collectives:
                continue
            per_step = max(1, round(issued / advanced))
            # Runs of per_step seqs from the first seen, each holding one step's end; a last run
            # cut short may hold none, and is left out unless it is the only one.
            first, last = collectives[0][0], collectives[-1][0]
            whole = max((last - first + 1) // per_step, 1)
            runs: dict[int, list[dict[int, int]]] = {}
            for seq, by_rank in collectives:
                if (seq - first) // per_step < whole:
                    runs.setdefault((seq - first) // per_step, []).append(by_rank)
            for run in runs.values():
                for rank in run[0]:
                    late = max(max(by_rank.values()) - by_rank[rank] for by_rank in run if rank in by_rank)
                    waited[rank] = waited.get(rank, 0.0) + late / 1e9 / len(runs)
        self._collective_wait_s = waited

    def _created(self, entries_by_rank: Mapping[int, Sequence[dict]]) -> dict[str, _Started]:
        """For each group: how many collectives it started since the last call (by their seqs), and
        for each one every rank of it has started, in order, its seq and when each rank created
        it (ns). A collective that some rank of the group has not reached yet waits for the next
        call, so that the rank latest of all is not left out of it. Groups torch describes as
        "undefined" (every unnamed one) cannot be told apart, and are left out."""
        by_group: dict[str, dict[int, dict[int, int]]] = {}
        for rank, entries in entries_by_rank.items():
            for entry in entries or ():
                seq, created, group = entry.get("seq"), entry.get("created_ns"), str(entry.get("group"))
                op = str(entry.get("op"))
                if (isinstance(seq, int) and isinstance(created, int) and group != "undefined"
                        and "send" not in op and "recv" not in op):  # point-to-point ops take no seq of their own
                    by_group.setdefault(group, {}).setdefault(rank, {})[seq] = created
        found: dict[str, _Started] = {}
        for group, ranks in sorted(by_group.items()):
            if len(ranks) < 2:
                continue
            reached = min(max(seqs) for seqs in ranks.values())
            seen = self._seen_seq.get(group)
            started_by_all = set.intersection(*(set(seqs) for seqs in ranks.values()))
            fresh = sorted(seq for seq in started_by_all if (seen or 0) < seq <= reached)
            # Before the first read the group's collectives so far are unknown: those seen stand for them.
            issued = reached - seen if seen is not None else len(fresh)
            found[group] = (issued, [(seq, {rank: seqs[seq] for rank, seqs in ranks.items()}) for seq in fresh])
            self._seen_seq[group] = max(seen or 0, reached)
        return found

    def _next_count(self, streaks: dict[int, _Streak], rank: int, kind: str) -> int:
        before = streaks.get(rank)
        return before.count + 1 if before is not None and before.kind == kind else 1


def _fraction(part: float, whole: float) -> float:
    return min(max(part / whole, 0.0), 1.0) if whole > 0 else 0.0


def _seconds(seconds: float) -> str:
    """`45 ms`, `0.21 s`, `1.5 s`, `12 s`, `3.5 min`."""
    if seconds < 0.1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"
