"""The goodput ledger of a call: its wall time, from run() to its end and across its attempts, split
into what it went to (PARTS), and the steps that failures threw away.

The call path (call.py) tells the ledger where each attempt begins and ends; the ranks' progress
records (_rank/progress.py), read as each attempt ends (run.py's on_ranks_ended), tell it when the
function began on every rank, when it was ready (its first collective or step ended), how long it
waited for data and was held by checkpoint saves, when it returned or raised, and the step of the
last save that completed. The parts are laid on one timeline in order, each from where the last
one stopped, so they add up to the wall time exactly; whatever is none of the named parts is
"other".

The attempts' boundaries come through five calls (attempt_started, locks_held, ranks_ended,
attempt_failed, attempt_ended), so that restarts that keep their processes can make the same
ones; each attempt's records are that attempt's own, as a rank's record is made anew for each
call of its function (_rank/progress.py's install).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence

from .._errors import FanrunError
from .._spec.progress_record import RankProgress

# What the wall time goes to, in the order of the line and the metrics.
PARTS = ("lock", "start", "setup", "steps", "data", "checkpoint", "detect", "restart", "other")
# How the line names each part; "steps" is the goodput itself.
_SHOWN = {"lock": "GPU wait", "start": "start", "setup": "set-up", "data": "data", "checkpoint": "checkpoint",
          "detect": "detect", "restart": "restart", "other": "other"}
# A part shorter than this is left out of the line (it still goes to the metrics and the record).
_SHOWN_FROM_S = 0.05
FILE = "goodput.json"  # in the run's record (records.py)


@dataclasses.dataclass(frozen=True)
class Goodput:
    """The ledger closed at one moment: `parts` (seconds, PARTS' keys) add up to `wall_s`."""

    wall_s: float
    parts: dict[str, float]
    steps: int  # the optimizer steps done, over the attempts (the most of any rank in each)
    steps_lost: int
    attempts: int
    observed: bool  # the ranks kept progress records (a watched call on this machine); else no steps are known

    @property
    def fraction(self) -> float:
        """The share of the wall time spent in training steps."""
        return self.parts["steps"] / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """e.g. 'goodput 93.1 %: start 4.2 s, checkpoint 1.3 s, restart 0.9 s, 12 steps lost'."""
        shown = [f"{_SHOWN[part]} {self.parts[part]:.1f} s" for part in PARTS
                 if part != "steps" and self.parts[part] >= _SHOWN_FROM_S]
        if self.steps_lost:
            shown.append(f"{self.steps_lost} step{'s' if self.steps_lost != 1 else ''} lost")
        return f"goodput {100 * self.fraction:.1f} % of {self.wall_s:.1f} s" + (f": {', '.join(shown)}" if shown else "")

    def metrics(self) -> dict[str, float]:
        """As the call's MLflow run holds them."""
        metrics = {f"fanrun/goodput/{part}_s": seconds for part, seconds in self.parts.items()}
        metrics.update({"fanrun/goodput/fraction": self.fraction, "fanrun/goodput/wall_s": self.wall_s,
                        "fanrun/goodput/steps": float(self.steps), "fanrun/goodput/steps_lost": float(self.steps_lost),
                        "fanrun/goodput/attempts": float(self.attempts)})
        return metrics

    def to_json(self) -> bytes:
        return json.dumps({"goodput": self.fraction, **dataclasses.asdict(self)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Goodput:
        fields = json.loads(data)
        fields.pop("goodput", None)
        return cls(**fields)


@dataclasses.dataclass
class _Attempt:
    started_at: float
    locks_at: float | None = None
    records: Sequence[RankProgress] = ()
    failure_seen_at: float | None = None  # the caller saw the first failed rank end
    failed_at: float | None = None  # the failure known to the call path (attempt_failed)
    steps_lost: int | None = None
    ended_at: float | None = None


class Ledger:
    """One call's ledger. Times are time.time()'s, the ranks' clock on this machine."""

    def __init__(self, started_at: float | None = None) -> None:
        self.started_at = time.time() if started_at is None else started_at
        self._attempts: list[_Attempt] = []

    def attempt_started(self, at: float | None = None) -> None:
        """An attempt begins: it takes the GPUs' locks next (the first), or restarts (any other)."""
        self._attempts.append(_Attempt(started_at=_now(at)))

    def locks_held(self, at: float | None = None) -> None:
        self._current().locks_at = _now(at)

    def ranks_ended(self, records: Sequence[RankProgress | None], failure_seen_at: float | None = None) -> None:
        """The attempt's ranks have ended: their last progress records, and when the caller saw
        the first one that failed end (None where none did)."""
        attempt = self._current()
        attempt.records = [record for record in records if record is not None]
        attempt.failure_seen_at = failure_seen_at

    def attempt_failed(self, at: float | None = None, steps_lost: int | None = None) -> None:
        """The attempt failed and the call knows it at `at`; `steps_lost`: the steps done since the
        last completed checkpoint, by default the most any rank's record shows."""
        attempt = self._current()
        attempt.failed_at = _now(at)
        attempt.steps_lost = steps_lost

    def attempt_ended(self, at: float | None = None) -> None:
        """The attempt ended well: its results are the call's."""
        self._current().ended_at = _now(at)

    def close(self, at: float | None = None) -> Goodput:
        """The ledger up to `at` (now): every part laid on one timeline from the call's start, each
        from where the last one stopped, so that they add up to the wall time."""
        end = _now(at)
        parts = dict.fromkeys(PARTS, 0.0)
        cursor = self.started_at

        def until(part: str, mark: float | None) -> float:
            """Gives `part` the time from the cursor to `mark`; returns how much."""
            nonlocal cursor
            if not mark or min(mark, end) <= cursor:
                return 0.0
            seconds, cursor = min(mark, end) - cursor, min(mark, end)
            parts[part] += seconds
            return seconds

        def waits(part: str, seconds: float, data_s: float, checkpoint_s: float) -> None:
            """Of `seconds` just given to `part`, the ranks' waits for data and checkpoint stalls are theirs."""
            data = min(data_s, seconds)
            checkpoint = min(checkpoint_s, seconds - data)
            parts[part] -= data + checkpoint
            parts["data"] += data
            parts["checkpoint"] += checkpoint

        steps = steps_lost = 0
        after_failure = False
        for attempt in self._attempts:
            ranks = attempt.records
            # The start ends once the function began and, where it imports torch itself, that import ended.
            began = _latest(max(r.began_at, r.torch_at) if r.began_at else 0.0 for r in ranks)
            ready = _latest(r.ready_at for r in ranks)
            if after_failure:
                # From the failure known to this attempt's first collective or step: restart downtime.
                lead_in = "restart", until("restart", ready or began or attempt.locks_at)
            else:
                until("other", attempt.started_at)
                until("lock", attempt.locks_at)
                until("start", began)
                lead_in = "setup", until("setup", ready)
            if ranks and ready:
                # The batches fetched before the first collective or step were waits for data too.
                waits(*lead_in, _mean(r.ready_data_s for r in ranks), 0.0)
            raised = min((r.failed_at for r in ranks if r.failed_at), default=0.0)
            failed = attempt.failed_at is not None or attempt.failure_seen_at is not None or raised > 0
            known = attempt.failure_seen_at or attempt.failed_at or end
            if failed:
                # A hang that a timeout or stall ended shows no failure time: its run ends with the
                # last sign of progress, and what follows until the call knew is detection.
                last_progress = max((r.progress_at for r in ranks), default=0.0)
                run_end = min(raised or attempt.failure_seen_at or last_progress or known, known)
            else:
                run_end = _latest(r.ended_at for r in ranks) or attempt.ended_at or end
            if ranks:
                ran = until("steps", run_end)
                waits("steps", ran, _mean(r.data_s - (r.ready_data_s if ready else 0.0) for r in ranks),
                      _mean(r.checkpoint_s for r in ranks))
            else:
                until("other", run_end)  # no records: what the ranks did is not known
            if failed:
                until("detect", known)
                if attempt.steps_lost is not None:
                    steps_lost += attempt.steps_lost
                else:
                    steps_lost += max((r.steps - r.checkpoint_step for r in ranks), default=0)
            steps += max((r.steps for r in ranks), default=0)
            after_failure = failed
        until("other", end)
        return Goodput(wall_s=end - self.started_at, parts=parts, steps=steps, steps_lost=steps_lost,
                       attempts=len(self._attempts), observed=any(a.records for a in self._attempts))

    def _current(self) -> _Attempt:
        if not self._attempts:
            raise RuntimeError("the ledger has no attempt: call attempt_started() first")
        return self._attempts[-1]


def _now(at: float | None) -> float:
    return time.time() if at is None else at


def _latest(marks) -> float:
    """The latest of the ranks' marks, 0 where a rank has not reached it (the call has not either)."""
    marks = list(marks)
    return 0.0 if not marks or not all(marks) else max(marks)


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def report(result: Goodput, record, say) -> None:
    """The call's end: its ledger kept in its record (fanrun.Run(id).goodput reads it there) and,
    where the ranks kept progress records and trained (optimizer steps) or restarted, said in one
    line. Neither hides the call's outcome."""
    if result.observed and (result.steps or result.attempts > 1):
        say(result.line())
    try:
        record.add(FILE, result.to_json())
    except (OSError, FanrunError) as error:
        say(f"run {record.id}'s record could not keep its goodput ledger: {error}")


def read(record) -> Goodput | None:
    """The ledger a run's record keeps; None before its end, or where it kept none."""
    data = record.read_bytes(FILE)
    return Goodput.from_json(data) if data is not None else None
