"""The live panel's plot of the ranks' metrics (loss by step, one line per rank), drawn with
matplotlib in the caller as a PNG. Drawing costs tens of milliseconds, so it is redrawn at most
once a second and no more often than keeps it under COST_FRACTION of one core. The figure is
built once and its lines given new points each time: building it and drawing it the first time
costs about twice a later drawing."""

from __future__ import annotations

import base64
import io
import time

MIN_INTERVAL_S = 1.0
# A fifth of the panel's budget of 1 % of one core for the drawings in between: a call's first
# and last drawing come on top, and the HTML, its messages to the notebook and the reading of
# the ranks' output take the rest.
COST_FRACTION = 0.002


class MetricPlot:
    # What a drawing cost in this process, last time: a new call's plot keeps the cadence of the
    # last one's from its start, and not from its second drawing.
    _last_cost_s = 0.0

    def __init__(self, ranks: int) -> None:
        # A line for each rank from the start: a figure built again costs a first drawing again.
        self._ranks = ranks
        self.png: str | None = None  # base64 of the last drawing
        self._drawn_at = -float("inf")
        self._cost_s = MetricPlot._last_cost_s
        self._available = True
        self._figure = None
        self._lines: dict[tuple[str, int], object] = {}  # (metric, rank) -> its Line2D
        self._axes: dict[str, object] = {}

    def due_in(self, now: float) -> float:
        return max(0.0, self._drawn_at + max(MIN_INTERVAL_S, self._cost_s / COST_FRACTION) - now)

    def draw(self, series: dict[str, dict[int, tuple]], now: float) -> None:
        """series: metric -> rank -> (steps, values)."""
        if not series or not self._available:
            return
        try:
            built = self._figure is None or list(self._axes) != list(series)
            if built:
                self._build(series)
        except ImportError:
            self._available = False  # no matplotlib: the panel goes without its plot
            return
        started = time.process_time()
        for key, by_rank in series.items():
            for rank, (steps, values) in by_rank.items():
                self._lines[key, rank].set_data(steps, values)
            axes = self._axes[key]
            axes.relim()
            axes.autoscale_view()
        buffer = io.BytesIO()
        self._figure.canvas.print_png(buffer)
        self.png = base64.b64encode(buffer.getvalue()).decode()
        if not built:
            # What a drawing costs sets the cadence. A new figure's first drawing, which lays out
            # its text for the first time, costs about twice as much: counted, it would hold the
            # plot's second drawing back twice as long.
            self._cost_s = MetricPlot._last_cost_s = time.process_time() - started
        self._drawn_at = now

    def _build(self, series: dict[str, dict[int, tuple]]) -> None:
        """A figure with an axes per metric logged so far and a line per rank."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend
        from matplotlib.ticker import MaxNLocator

        figure = Figure(figsize=(3.2 * len(series), 2.2), dpi=80)
        FigureCanvasAgg(figure)
        # Fixed margins: a layout engine would lay the figure out again at every drawing.
        figure.subplots_adjust(left=0.2 / len(series), right=1 - 0.03 / len(series), bottom=0.2, top=0.88,
                               wspace=0.35)
        self._figure, self._lines, self._axes = figure, {}, {}
        for index, key in enumerate(series):
            axes = self._axes[key] = figure.add_subplot(1, len(series), index + 1)
            for rank in range(self._ranks):
                self._lines[key, rank] = axes.plot([], [], linewidth=1, label=f"rank {rank}")[0]
            # Every place fixed, none found anew at each drawing (which costs a third of it): the
            # title's and the label's, the legend's, and fewer ticks to lay out.
            axes.set_title(key, fontsize=9, y=1.0, pad=4)
            axes.set_xlabel("step", fontsize=8)
            axes.xaxis.set_label_coords(0.5, -0.14)
            axes.tick_params(labelsize=7)
            for axis in (axes.xaxis, axes.yaxis):
                axis.set_major_locator(MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]))
            if self._ranks <= 8:
                axes.legend(fontsize=6, loc="upper right")
