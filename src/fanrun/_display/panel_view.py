"""The live panel as an output view (output_views.View): every rank's output goes into the panel
instead of onto the caller's streams, and the panel is redrawn in place: in a Jupyter cell as
one display output updated through its display id (HTML, with the rows as text beside it), in a
terminal as a block of rows moved over with cursor movements. A rank's lines stay in the panel's
logs and in the run's log files."""

from __future__ import annotations

import math

from .._core import Stream
from .output_views import Key, block_home, draw_block, fit, flush_streams, out, terminal_columns
from .panel import Panel
from .panel_metrics import MetricFiles
from .panel_plot import MetricPlot
from .panel_render import html_panel, text_rows

# At most this often, however fast the ranks print. A notebook's panel is sent as a message and
# rendered anew by the browser each time: once a second there, twice in a terminal.
REDRAW_EVERY_S = {"terminal": 0.5, "notebook": 1.0}
# The ranks' metric files are read this often while ranks run.
METRICS_EVERY_S = 1.0


class PanelView:
    def __init__(self, panel: Panel, surface: str, block_stream: Stream = Stream.STDERR, metrics: MetricFiles | None = None,
                 gpu_sample=None) -> None:
        self.panel = panel
        self._metrics = metrics
        self._gpu_sample = gpu_sample  # () -> [(utilisation %, memory MB)] in rank order
        self._metrics_read_at = -math.inf
        self._plot = MetricPlot(len(panel.rows)) if surface == "notebook" else None  # a terminal shows the last values
        self._plot_stale = False  # points read since the plot was drawn
        self._surface = surface  # "notebook" or "terminal"
        self._redraw_every = REDRAW_EVERY_S[surface]
        self.gather_s = self._redraw_every  # output is shown no sooner than the next redraw
        self._block_stream = block_stream  # a terminal's stream the block is drawn on
        self._dirty = True
        self._drawn_at = -math.inf
        self._handle = None  # the cell's display
        self._rows = 0  # the terminal block's rows on the screen now
        self._finished = False

    # ------------------------------------------------------------ View

    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        self.panel.line(key[0], whole, now)
        self._dirty = True

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        self.panel.partial(key[0], whole, now)
        self._dirty = True

    def progress(self, key: Key, text: str, now: float) -> None:
        self.panel.progress(key[0], text, now)
        self._dirty = True

    def due_in(self, now: float) -> float | None:
        waits = []
        if self._dirty:
            waits.append(max(0.0, self._drawn_at + self._redraw_every - now))
        stall = self.panel.next_stall_in(now)
        if stall is not None:
            waits.append(max(stall, self._drawn_at + self._redraw_every - now, 0.0))
        # A stalled rank's "no progress for N min" grows: redrawn each minute.
        if any(self.panel.stalled_for(rank, now) is not None for rank in range(len(self.panel.rows))):
            waits.append(max(0.0, self._drawn_at + 60.0 - now))
        if self._samples() and self.panel.any_running():
            waits.append(max(0.0, self._metrics_read_at + METRICS_EVERY_S - now))
        if self._plot_stale:
            waits.append(self._plot.due_in(now))
        return min(waits, default=None)

    def redraw(self, now: float) -> None:
        if self._samples() and now >= self._metrics_read_at + METRICS_EVERY_S:
            self._read_metrics(now)
        if self._plot_stale and self._plot.due_in(now) == 0:
            self._draw_plot(now)
        due = self.due_in(now)
        if due is not None and due == 0:
            self._draw(now)

    def _samples(self) -> bool:
        return self._metrics is not None or self._gpu_sample is not None

    def _read_metrics(self, now: float) -> None:
        """The ranks' logged metrics and their GPUs' samples, read again."""
        self._metrics_read_at = now
        if self._gpu_sample is not None:
            try:
                samples = self._gpu_sample()
            except Exception:  # NVML gone (a driver reset): the panel goes on without it
                self._gpu_sample, samples = None, []
            for row, sample in zip(self.panel.rows, samples):
                row.gpu = sample
            self._dirty = True
        if self._metrics is None:
            return
        logged = self._metrics.read_new()
        for rank in logged:
            self.panel.metrics(rank, {key: by_rank[rank][1][-1] for key, by_rank in self._metrics.series.items()
                                      if rank in by_rank}, now)
        if logged:
            self._dirty = True
            self._plot_stale = self._plot is not None

    def _draw_plot(self, now: float) -> None:
        self._plot.draw(self._metrics.series, now)
        self.panel.plot_png = self._plot.png
        self._plot_stale = False
        self._dirty = True

    def watched(self, steps: list[str], watch_flags: list[list[str]], stall: str) -> None:
        self.panel.watched(steps, watch_flags, stall)
        self._dirty = True

    def close(self) -> None:
        pass  # finish() draws the last state, once the call's outcome is known

    # ------------------------------------------------------------ the call's end

    def started(self, now: float) -> None:
        self.panel.started(now)
        self._draw(now)

    def exited(self, rank: int, exit_code: int, signal: int, now: float) -> None:
        self.panel.exited(rank, exit_code, signal)
        self._dirty = True

    def finish(self, ended_well: bool, failed_rank: int | None, failure: list[str], now: float) -> None:
        if self._finished:
            return
        self._finished = True
        if self._samples():
            self._read_metrics(now)
            if self._plot_stale:
                self._draw_plot(now)  # the last points, whatever the plot's cadence
        self.panel.finish(ended_well, failed_rank, failure)
        if self._surface == "terminal":
            # Written over the block, each row whole, what is left below it erased: erasing the
            # whole block first would clear the screen from its top, which tmux keeps in its history.
            stream = out(self._block_stream)
            width = terminal_columns(stream) - 1  # as the block's rows: a wider one would wrap
            rows = [fit(row, width) for row in text_rows(self.panel, now, colour=True, width=width)]
            stream.write(block_home(self._rows) + "".join(row + "\x1b[K\n" for row in rows) + "\x1b[J")
            stream.flush()
            self._rows = 0
        else:
            self._draw(now)

    # ------------------------------------------------------------ drawing

    def _draw(self, now: float) -> None:
        if self._surface == "notebook":
            self._draw_in_cell(now)
        else:
            self._draw_in_terminal(now)
        self._dirty = False
        self._drawn_at = now

    def _bundle(self, now: float) -> dict[str, str]:
        rows = text_rows(self.panel, now)
        logs = [f"[rank{rank}]: {text}" for rank, text in self.panel.logs]
        return {"text/html": html_panel(self.panel, now), "text/plain": "\n".join(rows + logs)}

    def _draw_in_cell(self, now: float) -> None:
        if self._handle is None:
            from IPython.display import display

            flush_streams()  # what the caller printed before the call stays above the panel
            self._handle = display(self._bundle(now), raw=True, display_id=True)
        else:
            self._handle.update(self._bundle(now), raw=True)

    def _draw_in_terminal(self, now: float) -> None:
        stream = out(self._block_stream)
        rows = text_rows(self.panel, now, colour=True, width=terminal_columns(stream) - 1)
        self._rows = draw_block(stream, rows, self._rows)


class QuietView:
    """display="quiet": nothing on the caller's streams; the run's logs keep every line."""

    gather_s = 1.0  # nothing waits for the output but the stderr kept for a failure's message

    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        pass

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        pass

    def progress(self, key: Key, text: str, now: float) -> None:
        pass

    def due_in(self, now: float) -> float | None:
        return None

    def redraw(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass
