"""Writes the ranks' output to the caller's sys.stdout / sys.stderr, labelled by rank.

The engine hands up lines, starts of lines not ended yet, and progress states (a line
redrawn with '\\r'). Every view gets them without control sequences, and at most
SHOWN_LINE_CHARS of a line. With display="logs", output_views.py shows them as the caller's stream
allows: a bar stays one row in a terminal, in a Jupyter cell and (bounded) in a file or pipe.
With display="panel", they feed one live panel instead (panel_view.py); with "quiet", only the
run's logs get them.
"""

from __future__ import annotations

import codecs
import collections
import os
import sys
import time
from pathlib import Path

from .. import _core
from .._rank import contract
from .output_views import View, caller_surface, flush_streams, terminal_block_stream, views_for_streams, visible
from .panel import Panel
from .panel_metrics import MetricFiles
from .panel_view import PanelView, QuietView

DISPLAYS = ("panel", "logs", "quiet")

TAIL_LINES = 40
# Of one line, a display shows and holds this many characters; the rest is counted, and said at
# the line's end. The rank's log keeps the whole line. A rank can print a line of gigabytes, with
# no newline: shown whole, it would cost the caller as much memory, and a notebook its browser.
SHOWN_LINE_CHARS = 64 * 1024

# Every line of every rank passes through OutputMux.write: the names it compares with, looked up once.
_PROGRESS, _PARTIAL = _core.SegmentKind.PROGRESS, _core.SegmentKind.PARTIAL
_STDERR = _core.Stream.STDERR


def default_display() -> str | None:
    """$FANRUN_DISPLAY: a user's choice for every call that does not pass display=."""
    value = os.environ.get("FANRUN_DISPLAY") or None
    if value is not None and value not in DISPLAYS:
        raise ValueError(f"FANRUN_DISPLAY={value!r} is not a display: set it to panel, logs or quiet, or unset it "
                         f"(the panel in a notebook, logs elsewhere)")
    return value


class OutputMux:
    def __init__(self, world_size: int, display: str | None = None, where: list[str] | None = None,
                 stall_warning: float | None = None, hints: tuple[str, str] = ("", ""),
                 run_dir: Path | None = None, open_gpu_sample=None, title: str = "") -> None:
        """display: "panel", "logs", "quiet", or None: $FANRUN_DISPLAY where set, else the panel in a
        notebook and logs elsewhere. A panel asked for on a file or a pipe is logs there: nothing
        can be redrawn in place. `hints`: what a panel says below its rows while the call runs, and
        once it has ended; `title`, above them."""
        self._labels = [f"[rank{r}]: " for r in range(world_size)]
        display = display or default_display()
        surface = caller_surface()
        self.panel: PanelView | None = None
        if display == "quiet":
            quiet = QuietView()
            self._views: dict[_core.Stream, View] = {stream: quiet for stream in _core.Stream}
        elif (display == "panel" and surface != "plain") or (display is None and surface == "notebook"):
            panel = Panel(world_size, where or ["" for _ in range(world_size)], time.monotonic(), stall_warning, *hints,
                          title=title)
            metrics = MetricFiles(run_dir, world_size) if run_dir is not None else None
            gpu_sample = open_gpu_sample() if open_gpu_sample is not None else None
            self.panel = PanelView(panel, surface, terminal_block_stream(), metrics, gpu_sample)
            self._views = {stream: self.panel for stream in _core.Stream}
        else:
            self._views = views_for_streams(self._labels)
        self.gather_s = min(view.gather_s for view in self._unique_views())  # for the engine's wait
        self._lines: dict[tuple[int, _core.Stream], _LineShown] = {}  # (rank, stream) -> its line so far
        self.stderr_tails = [collections.deque(maxlen=TAIL_LINES) for _ in range(world_size)]
        self._capturing: dict[int, list[str]] | None = None
        self._watched: tuple = ()
        self._stragglers_said: set[tuple[int, str]] = set()  # (rank, "straggler: compute"), without a panel

    def capture_stderr(self) -> dict[int, list[str]]:
        """From now on, keep every stderr line per rank instead of showing it (the stacks dumped
        at a timeout, which the timeout's exception shows once)."""
        self._capturing = collections.defaultdict(list)
        return self._capturing

    def write(self, rank: int, stream: _core.Stream, segment: _core.SegmentKind, data: bytes) -> None:
        key = (rank, stream)
        view = self._views[stream]
        now = time.monotonic()
        if segment is _PROGRESS:
            self._lines.pop(key, None)  # the line is redrawn from its start
            view.progress(key, _LineShown().add(data, final=True), now)
            return
        shown = self._lines.pop(key, None) or _LineShown()
        if segment is _PARTIAL:
            self._lines[key] = shown
            piece = shown.add(data)
            if piece:
                view.partial(key, piece, shown.text, now)
            return
        end = shown.add(data, final=True)
        note = shown.left_out_note(rank)
        rest, line = end + note, shown.text + note
        if stream is _STDERR:
            self.stderr_tails[rank].append(line)
            if self._capturing is not None:
                self._capturing[rank].append(line)
                return
        view.line(key, line, rest, now)

    @property
    def rank_env(self) -> dict[str, str]:
        """What the ranks need to know of this display: whether to write their metrics for the panel."""
        return {contract.ENV_PANEL_METRICS: "1"} if self.panel is not None else {}

    def started(self) -> None:
        if self.panel is not None:
            self.panel.started(time.monotonic())

    def rank_exited(self, rank: int, exit_code: int, signal: int) -> None:
        if self.panel is not None:
            self.panel.exited(rank, exit_code, signal, time.monotonic())

    def watched(self, steps: list[str], watch_flags: list[list[str]], stall: str) -> None:
        """The stall watch's latest (_launch/stall_watch.py): each rank's step column and flags,
        and the verdict of a stall that lasts; the panel shows them. Elsewhere a straggler is said
        once on stderr, when it is first flagged for its reason."""
        if self.panel is not None and (steps, watch_flags, stall) != self._watched:
            self._watched = (steps, watch_flags, stall)
            self.panel.watched(steps, watch_flags, stall)
        if self.panel is None:
            for rank, flags in enumerate(watch_flags):
                for flag in flags:
                    reason = flag.partition(",")[0]
                    if flag.startswith("straggler:") and (rank, reason) not in self._stragglers_said:
                        self._stragglers_said.add((rank, reason))
                        flush_streams()
                        print(f"fanrun: rank {rank} is a {flag}", file=sys.stderr, flush=True)

    def stall(self, report, hint: str) -> None:
        """A stall's report (_launch/stall_report.py): a panel shows its verdict (watched());
        elsewhere it is said once, on stderr, whatever the display."""
        if self.panel is not None:
            # At once: "abort", or a function that raises, ends the call before the next watched().
            steps = [row.step for row in self.panel.panel.rows]
            flags = [[*row.watch_flags, *(["stalled"] if rank in report.culprits else [])]
                     for rank, row in enumerate(self.panel.panel.rows)]
            self.panel.watched(steps, flags, report.sentence)
            return
        flush_streams()
        print(f"fanrun: run {report.run_id} stalled: {report.sentence} (no progress for {report.quiet_s:.0f} s). "
              f"{hint}", file=sys.stderr, flush=True)

    def finish(self, ended_well: bool, failed_rank: int | None = None, failure: list[str] = ()) -> None:
        """The call's outcome is known: the panel shows its last state (the root cause's row red,
        with the last lines of its traceback)."""
        if self.panel is not None:
            self.panel.finish(ended_well, failed_rank, list(failure), time.monotonic())
            flush_streams()

    def seconds_to_redraw(self) -> float:
        """How long the engine may wait before a live display is due a redraw; -1: no limit."""
        now = time.monotonic()
        waits = [wait for view in self._unique_views() if (wait := view.due_in(now)) is not None]
        return min(waits, default=-1.0)

    def flush(self) -> None:
        """Redraws the live displays that are due, and sends what was written on."""
        now = time.monotonic()
        for view in self._unique_views():
            view.redraw(now)
        flush_streams(written_only=True)

    def close(self) -> None:
        for view in self._unique_views():
            view.close()
        flush_streams()

    def _unique_views(self) -> list[View]:
        return list({id(view): view for view in self._views.values()}.values())


class _LineShown:
    """What the displays are shown of one line of a rank's stream, piece by piece: its first
    SHOWN_LINE_CHARS characters without control sequences (output_views.visible); the rest only
    counted. A character whose bytes two pieces split is decoded whole."""

    def __init__(self) -> None:
        # Made for a line that comes in pieces; one that comes whole, as most do, is decoded at once.
        self._decoder: codecs.IncrementalDecoder | None = None
        self._taken = 0  # characters of the line shown, counted before visible() took any out
        self.left_out = 0  # characters of the line not shown
        self.text = ""  # all of the line shown so far

    def add(self, data: bytes, final: bool = False) -> str:
        """What `data` adds to the line, as shown; final: the line ends with it."""
        if final and self._decoder is None:
            decoded = data.decode("utf-8", "replace")
        else:
            if self._decoder is None:
                self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
            decoded = self._decoder.decode(data, final)
        taken = decoded[:max(SHOWN_LINE_CHARS - self._taken, 0)]
        self._taken += len(taken)
        self.left_out += len(decoded) - len(taken)
        piece = visible(taken)
        self.text += piece  # at most SHOWN_LINE_CHARS, in few pieces: the engine's are 64 KiB or time apart
        return piece

    def left_out_note(self, rank: int) -> str:
        """Said at the end of a line of `rank` cut short; nothing for a line shown whole."""
        if not self.left_out:
            return ""
        return (f" [... {self.left_out:,} more characters: {contract.log_name(rank)} in the run's directory holds "
                f"the whole line]")
