"""What the live panel knows of each rank of a call: where it runs, its state, its progress bar
(read back from the line it redraws), its last line, when it last showed a sign of life, and
how a failed rank ended. Rendering is panel_render.py's; showing it, panel_view.py's."""

from __future__ import annotations

import collections
import dataclasses
import statistics

from .terminal_text import printable
from . import progress_text
from .progress_text import Progress

# Lines of the whole call kept for the logs shown under the panel; the run's logs keep them all.
LOG_LINES = 500
# Of each line, what the panel keeps (for its logs, a rank's last line, a bar drawn as it came):
# a row shows less, and 500 lines of 64 KiB each would be drawn into every redraw's text.
LINE_CHARS = 1000
# Lines of the root cause's traceback shown in its row.
FAILURE_LINES = 8
# A rank is a straggler when its rate is below this fraction of the ranks' median.
STRAGGLER_FRACTION = 0.5


@dataclasses.dataclass
class RankRow:
    where: str
    state: str = "starting"
    progress: Progress | None = None
    bar_text: str = ""  # the redrawn line as the rank drew it, for a bar without a count
    last_line: str = ""
    active_at: float = 0.0  # its last output, progress or logged metric
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the last value of each
    gpu: tuple[float | None, float | None] | None = None  # its GPU's utilisation %, memory used in MB
    failure: list[str] = dataclasses.field(default_factory=list)
    step: str = ""  # its step time and split, from the stall watch ("step 0.21 s · data 5% · comm 40%")
    watch_flags: list[str] = dataclasses.field(default_factory=list)  # the stall watch's: straggler, stalled


class Panel:
    def __init__(self, world_size: int, where: list[str], started_at: float, stall_warning: float | None,
                 run_hint: str = "", ended_hint: str = "", title: str = "") -> None:
        self.title = title  # above the rows, from start to end: the run's id, and what it runs on
        self.rows = [RankRow(where[rank], active_at=started_at) for rank in range(world_size)]
        self.stall_warning = stall_warning
        self.run_hint = run_hint  # how to see more while it runs: `fanrun stacks`, the logs
        self._ended_hint = ended_hint  # and once it ended
        self.logs: collections.deque[tuple[int, str]] = collections.deque(maxlen=LOG_LINES)
        self.lines_seen = 0
        self.plot_png: str | None = None  # base64: the ranks' metrics plotted (panel_plot.py)
        self.ended = False
        self.stall = ""  # the stall's verdict, shown until progress resumes

    # ------------------------------------------------------------ what the ranks show

    def started(self, now: float) -> None:
        """The ranks' processes run: a sign of life for the stall clock, whatever they print."""
        for row in self.rows:
            row.state, row.active_at = "running", now

    def line(self, rank: int, text: str, now: float) -> None:
        row = self._alive(rank, now)
        final_bar = progress_text.parse(text, tqdm_only=True)
        text = _kept(text)
        if final_bar is not None:  # a bar's last state, ended with a newline (tqdm's close)
            row.progress, row.bar_text = final_bar, text
        elif text.strip():
            row.last_line = text
        self.logs.append((rank, text))
        self.lines_seen += 1

    def partial(self, rank: int, text: str, now: float) -> None:
        """A line not ended yet ("waiting..."): its row shows it; the logs get it once it ends."""
        row = self._alive(rank, now)
        if text.strip():
            row.last_line = _kept(text)

    def progress(self, rank: int, text: str, now: float) -> None:
        row = self._alive(rank, now)
        if not text.strip():
            return  # the bar was erased: the last state stays shown
        row.bar_text = _kept(text)
        parsed = progress_text.parse(text)
        if parsed is not None:
            row.progress = parsed

    def metrics(self, rank: int, latest: dict[str, float], now: float) -> None:
        self._alive(rank, now).metrics.update(latest)

    def watched(self, steps: list[str], watch_flags: list[list[str]], stall: str) -> None:
        """What the stall watch saw last: each rank's step column and flags, and the stall's verdict."""
        for row, step, flagged in zip(self.rows, steps, watch_flags):
            row.step, row.watch_flags = step, flagged
        self.stall = stall

    def exited(self, rank: int, exit_code: int, signal: int) -> None:
        row = self.rows[rank]
        if row.state == "failed":
            return
        row.state = "done" if exit_code == 0 and signal == 0 else "stopped" if signal else "failed"

    def failed(self, rank: int, traceback: list[str]) -> None:
        row = self.rows[rank]
        row.state = "failed"
        # The rank's own words (its exception's message): no control sequence reaches the screen.
        row.failure = [_kept(printable(line, keep="\t")) for line in traceback if line.strip()][-FAILURE_LINES:]

    def finish(self, ended_well: bool, failed_rank: int | None = None, traceback: list[str] = ()) -> None:
        """At the call's end: the root cause's row gets its traceback; ranks still shown as
        running were done, or stopped with a call that did not end well."""
        self.run_hint = self._ended_hint
        self.ended = True
        if failed_rank is not None and 0 <= failed_rank < len(self.rows):
            self.failed(failed_rank, list(traceback))
        for row in self.rows:
            if row.state in ("starting", "running"):
                row.state = "done" if ended_well else "stopped"

    # ------------------------------------------------------------ what the panel flags

    def stalled_for(self, rank: int, now: float) -> float | None:
        """Seconds without a sign of life, once past stall_warning; None otherwise."""
        row = self.rows[rank]
        if self.stall_warning is None or row.state not in ("starting", "running"):
            return None
        quiet = now - row.active_at
        return quiet if quiet >= self.stall_warning else None

    def stragglers(self) -> set[int]:
        """Running ranks whose progress rate is below half the median of the ranks' rates."""
        rates = {rank: row.progress.rate for rank, row in enumerate(self.rows)
                 if row.state == "running" and row.progress is not None and row.progress.rate is not None}
        if len(rates) < 2:
            return set()
        median = statistics.median(rates.values())
        return {rank for rank, rate in rates.items() if rate < STRAGGLER_FRACTION * median}

    def next_stall_in(self, now: float) -> float | None:
        """Seconds until a rank not yet flagged would be: the panel is redrawn then."""
        if self.stall_warning is None:
            return None
        waits = [row.active_at + self.stall_warning - now for row in self.rows
                 if row.state in ("starting", "running") and now - row.active_at < self.stall_warning]
        return max(min(waits), 0.0) if waits else None

    def any_running(self) -> bool:
        return any(row.state == "running" for row in self.rows)

    def _alive(self, rank: int, now: float) -> RankRow:
        row = self.rows[rank]
        row.active_at = now
        return row


def _kept(text: str) -> str:
    if len(text) <= LINE_CHARS:
        return text
    cut = text[:LINE_CHARS]
    escape = cut.rfind("\x1b", LINE_CHARS - 32)
    if escape >= 0 and "m" not in cut[escape:]:  # a colour cut through: left out whole
        cut = cut[:escape]
    return cut + " [...]"
