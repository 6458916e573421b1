"""The live panel's plot of the ranks' metrics (loss by step, one line per rank), drawn with
matplotlib in the caller as a PNG. Drawing costs tens of milliseconds, so it is redrawn at most
once a second and no more often than keeps it under COST_FRACTION of one core."""

from __future__ import annotations

import base64
import io
import time

MIN_INTERVAL_S = 1.0
COST_FRACTION = 0.01


class MetricPlot:
    def __init__(self) -> None:
        self.png: str | None = None  # base64 of the last drawing
        self._drawn_at = -float("inf")
        self._cost_s = 0.0
        self._available = True

    def due_in(self, now: float) -> float:
        return max(0.0, self._drawn_at + max(MIN_INTERVAL_S, self._cost_s / COST_FRACTION) - now)

    def draw(self, series: dict[str, dict[int, tuple]], now: float) -> None:
        """series: metric -> rank -> (steps, values)."""
        if not series or not self._available:
            return
        started = time.process_time()
        try:
            self.png = _render(series)
        except ImportError:
            self._available = False  # no matplotlib: the panel goes without its plot
            return
        self._cost_s = time.process_time() - started
        self._drawn_at = now


def _render(series: dict[str, dict[int, tuple]]) -> str:
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    figure = Figure(figsize=(3.2 * len(series), 2.2), dpi=80, layout="constrained")
    for index, (key, by_rank) in enumerate(series.items()):
        axes = figure.add_subplot(1, len(series), index + 1)
        for rank, (steps, values) in sorted(by_rank.items()):
            axes.plot(steps, values, linewidth=1, label=f"rank {rank}")
        axes.set_title(key, fontsize=9)
        axes.set_xlabel("step", fontsize=8)
        axes.tick_params(labelsize=7)
        if len(by_rank) <= 8:
            axes.legend(fontsize=6)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode()
