"""What a stall report holds: each rank's progress record as read (_spec/progress_record.py), the
evidence gathered from it without stopping it, and the verdict (verdict.py) in one sentence."""

from __future__ import annotations

import dataclasses
import json

from .._rank import contract
from .._spec.progress_record import RankProgress

# The report's files, in the attempt's run directory and in the run's record.
REPORT_JSON, REPORT_TEXT = contract.STALL_REPORT_JSON, contract.STALL_REPORT_TEXT


@dataclasses.dataclass(frozen=True)
class RankEvidence:
    """What was gathered from one rank when the call stalled, without stopping it."""

    rank: int
    progress: RankProgress | None  # None: no record (a native program's rank, or one not started yet)
    running: bool  # False: it had ended by then
    stack: str  # every thread's stack as faulthandler wrote it; "" where none came
    # The main thread's stack, outermost first, as (file, line, function): from the rank's
    # forensics thread, else the first thread of `stack`.
    main_frames: tuple[tuple[str, int, str], ...]
    # Its forensics thread answered: its Python threads can run. False for a running rank means
    # native code holds the GIL (or the rank blocks the thread otherwise).
    answered: bool
    # The flight recorder's last collectives: dicts of seq, op, state, created_ns and group;
    # None where torch keeps no record (or the rank did not answer).
    collectives: tuple[dict, ...] | None
    last_lines: tuple[str, ...]  # its last lines of output
    # Why it could not be asked, where it could not (a node's agent that gave nothing in time, or
    # failed to ask): nothing else here is evidence then.
    unasked: str = ""


@dataclasses.dataclass(frozen=True)
class Verdict:
    sentence: str  # one sentence that names the culprit and the reason
    culprits: tuple[int, ...]  # the ranks it blames; () where none can be told
    # "data", "mismatch", "skipped" (never entered a collective its peers wait in), "native-gil",
    # "native", "compute", "collective" (every rank waits in the same one), "unknown"
    cause: str


@dataclasses.dataclass(frozen=True)
class StallReport:
    """A stall of a call: handed to on_stall's callable, raised with RankStalledError, written
    to the run's directory and record, and shown by `fanrun stacks ID`."""

    run_id: str
    attempt: int
    quiet_s: float  # how long no progress was seen
    threshold_s: float  # the stall timeout it crossed
    at: float  # time.time() of the report
    verdict: Verdict
    ranks: tuple[RankEvidence, ...]

    @property
    def sentence(self) -> str:
        return self.verdict.sentence

    @property
    def culprits(self) -> tuple[int, ...]:
        return self.verdict.culprits

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_text(self) -> str:
        """The verdict, then each rank's state, last collectives, last lines and stack."""
        out = [f"run {self.run_id}: stall: {self.verdict.sentence}",
               f"(no progress for {self.quiet_s:.0f} s; the stall timeout is {self.threshold_s:g} s)", ""]
        for rank in self.ranks:
            out.append(f"--- rank {rank.rank} ---")
            progress = rank.progress
            if progress is not None:
                doing = f"in {progress.op} #{progress.collectives}" if progress.state == "collective" else progress.state
                out.append(f"{doing} for {self.at - progress.state_since:.1f} s; {progress.steps} steps, "
                           f"{progress.batches} batches, {progress.collectives} collectives")
            if rank.unasked:
                out.append(f"it could not be asked: {rank.unasked}")
            elif not rank.running:
                out.append("it had ended")
            elif not rank.answered:
                out.append("its Python threads could not run: native code holds the GIL")
            for entry in rank.collectives or ():
                out.append(f"  collective #{entry.get('seq')} {entry.get('op')} {entry.get('state')}")
            if rank.last_lines:
                out.append("last lines:")
                out.extend(f"  {line}" for line in rank.last_lines)
            if rank.stack:
                out.append(rank.stack.rstrip())
            out.append("")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.verdict.sentence
