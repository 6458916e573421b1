"""The stall watch of one attempt: it reads every rank's progress record (_rank/progress.py) while
the call runs, and once no progress has been seen for the stall timeout, it gathers the evidence
(forensics.py) without stopping anything, names the culprit (verdict.py) and hands the report on:
to the display, the run's directory and record, and on_stall.

Progress is a step, a batch, a collective that ended, or a progress bar's redraw. The timeout is
the caller's stall_timeout, else the larger of MIN_AUTO_S and AUTO_STEPS step times once steps
have been seen, else BEFORE_STEPS_S.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .. import _core
from .._rank import contract
from .._spec.paths import RunPaths
from .._spec.progress_record import COLLECTIVE_WAITS_NAME, encode_collective_waits
from ..backends import rank_evidence
from . import forensics
from .stall_report import RankProgress, StallReport
from .straggler import StragglerWatch
from .verdict import verdict

MIN_AUTO_S = 60.0
AUTO_STEPS = 10
BEFORE_STEPS_S = 300.0
# The records are read this often for the live step times and the straggler flags; a stall is
# looked for at each read too, and at the moment the timeout would fall due.
READ_EVERY_S = 1.0
# A rank that ends failed while nothing else stops the ranks is a failure of its own; one that
# ends as a timeout or a cancel (a stall's abort, an interrupt) stops it is not.
_OWN_FAILURE = (_core.StopReason.NONE, _core.StopReason.RANK_FAILED)


def timeout_for(step_times: list[float], given: float | None) -> float:
    """The stall timeout: `given`, else one tied to the median step time, once steps are seen."""
    if given is not None:
        return given
    steps = [step for step in step_times if step > 0]
    if not steps:
        return BEFORE_STEPS_S
    return max(MIN_AUTO_S, AUTO_STEPS * statistics.median(steps))


class StallWatch:
    def __init__(self, paths: RunPaths, ranks, attempt: int, stall_timeout: float | None,
                 on_report: Callable[[StallReport], None]) -> None:
        self._paths = paths
        self._ranks = ranks
        self._attempt = attempt
        self._given = stall_timeout
        self._on_report = on_report
        self._world_size = ranks.world_size
        started = time.time()
        self._seen_at = [started] * self._world_size  # the last progress seen of each rank
        self._ended: set[int] = set()
        self.failure_seen_at: float | None = None  # when the first rank that failed of itself was seen to end
        self._reported_at: float | None = None  # the stall reported, until progress resumes
        self._read_at = -1.0
        self.progress: list[RankProgress | None] = [None] * self._world_size
        self.stragglers = StragglerWatch()
        # The ranks' flight recorders, asked every COLLECTIVES_EVERY_S once they step: each rank's
        # last answer, and when it was written.
        self._collectives: dict[int, list[dict]] = {}
        self._collectives_at: dict[int, float] = {}
        self._collectives_asked_at = -1.0
        self.flagged: list = []
        self.reports: list[StallReport] = []

    def beat(self, rank: int) -> None:
        """A progress bar of `rank` was redrawn."""
        self._seen_at[rank] = time.time()

    def ended(self, rank: int, failed: bool = False) -> None:
        self._ended.add(rank)
        if failed and self.failure_seen_at is None and self._ranks.stop_reason in _OWN_FAILURE:
            self.failure_seen_at = time.time()

    def last_read(self) -> list[RankProgress | None]:
        """Every rank's record as the attempt ends: what the goodput ledger (goodput.py) takes."""
        self._read()
        return list(self.progress)

    def seconds_to_check(self) -> float:
        """How long the pump may wait before this watch is due."""
        return max(self._read_at + READ_EVERY_S - time.monotonic(), 0.0)

    def check(self) -> None:
        """Reads the records if due; reports a stall once its timeout has passed."""
        if time.monotonic() - self._read_at < READ_EVERY_S:
            return
        self._read_at = time.monotonic()
        self._read()
        self._follow_collectives()
        running = [rank for rank in range(self._world_size) if rank not in self._ended]
        if not running:
            return
        now = time.time()
        last = max(self._seen_at[rank] for rank in running)
        if self._reported_at is not None:
            if last <= self._reported_at:
                return
            self._reported_at = None  # progress again: a later stall is a new one
        threshold = timeout_for([p.step_s for p in self.progress if p is not None], self._given)
        quiet = now - last
        # The whole call, or one rank that is not waiting for its peers in a collective.
        alone = [rank for rank in running if now - self._seen_at[rank] >= threshold
                 and not (self.progress[rank] and self.progress[rank].state == "collective")]
        if quiet < threshold and not alone:
            return
        quiet = max(quiet, *(now - self._seen_at[rank] for rank in alone)) if alone else quiet
        self._reported_at = now
        evidence = forensics.gather(self._paths, self._ranks, self._ended, self.progress)
        report = StallReport(run_id=self._paths.run_id, attempt=self._attempt, quiet_s=quiet, threshold_s=threshold,
                             at=time.time(), verdict=verdict(evidence, time.time()), ranks=tuple(evidence))
        self.reports.append(report)
        self._on_report(report)

    def shown(self) -> tuple[list[str], list[list[str]], str]:
        """What a panel shows of it: each rank's step column and flags, and a lasting stall's verdict."""
        steps = [self.stragglers.row_words(rank) for rank in range(self._world_size)]
        flags: list[list[str]] = [[] for _ in range(self._world_size)]
        for straggler in self.flagged:
            flags[straggler.rank].append(f"straggler: {straggler.reason}, {straggler.ratio:.1f}x the others' step")
        stall = ""
        if self._reported_at is not None and self.reports:
            stall = self.reports[-1].sentence
            for rank in self.reports[-1].culprits:
                flags[rank].append("stalled")
        return steps, flags, stall

    def _follow_collectives(self) -> None:
        """Takes the ranks' newest answers with their flight recorders' collectives to the straggler
        watch, which learns from them who starts each collective last and how long the others wait
        (DDP's all-reduces, which no record shows), and asks again, once the ranks step."""
        if self._world_size < 2:
            return
        fresh = False
        for rank in range(self._world_size):
            answer = rank_evidence.collectives(self._paths.directory / contract.forensics_collectives_name(rank))
            if answer is not None and answer[0] > self._collectives_at.get(rank, 0.0):
                self._collectives_at[rank], self._collectives[rank] = answer
                fresh = True
        if fresh:
            self.flagged = self.stragglers.update_collectives(self._collectives)
            self._paths.write_file(COLLECTIVE_WAITS_NAME, encode_collective_waits(self.stragglers.collective_waits()))
        stepping = any(progress is not None and progress.steps > 0 for progress in self.progress)
        if stepping and time.monotonic() - self._collectives_asked_at >= rank_evidence.COLLECTIVES_EVERY_S:
            self._collectives_asked_at = time.monotonic()
            self._ranks.ask_for_collectives(self._ended)

    def _read(self) -> None:
        for rank in range(self._world_size):
            progress = RankProgress.read(self._paths.directory / contract.progress_name(rank), rank)
            if progress is None:
                continue
            self.progress[rank] = progress
            self._seen_at[rank] = max(self._seen_at[rank], progress.progress_at)
        self.flagged = self.stragglers.update(self.progress, time.time())
