"""The metric points the ranks log, read back for the live panel from the files the ranks append
to (_rank/panel_feed.py): each time the panel redraws, what was appended since.

The points are kept in arrays of floats and parsed without a container per line: thousands of
tuples a second would make the garbage collector walk the caller's whole heap (torch's included)
again and again, which cost more than everything else the panel does.
"""

from __future__ import annotations

import array
from pathlib import Path

from .._rank.contract import panel_metrics_name

# Points kept per metric and rank: past this, every other one is dropped (the plot's resolution).
MAX_POINTS = 2000
# Metrics plotted: the first ones logged.
MAX_METRICS = 3


class MetricFiles:
    def __init__(self, run_dir: Path, world_size: int) -> None:
        self._paths = [run_dir / panel_metrics_name(rank) for rank in range(world_size)]
        self._offsets = [0] * world_size
        self._partial = [b""] * world_size  # a line the rank has not finished writing
        # metric -> rank -> (steps, values)
        self.series: dict[str, dict[int, tuple[array.array, array.array]]] = {}

    def read_new(self) -> set[int]:
        """Reads what each rank appended; returns the ranks that logged something."""
        logged = set()
        for rank, path in enumerate(self._paths):
            try:
                with open(path, "rb") as file:
                    file.seek(self._offsets[rank])
                    data = file.read()
            except FileNotFoundError:
                continue
            if not data:
                continue
            self._offsets[rank] += len(data)
            data = self._partial[rank] + data
            complete, _, self._partial[rank] = data.rpartition(b"\n")
            self._add(rank, complete.decode("utf-8", "replace").split("\n"))
            logged.add(rank)
        return logged

    def _add(self, rank: int, lines: list[str]) -> None:
        series = self.series
        for line in lines:
            first = line.find("\t")
            second = line.find("\t", first + 1)
            if first < 0 or second < 0:
                continue
            try:
                step, value = float(line[first + 1:second]), float(line[second + 1:])
            except ValueError:
                continue
            key = line[:first]
            by_rank = series.get(key)
            if by_rank is None:
                if len(series) >= MAX_METRICS:
                    continue
                by_rank = series[key] = {}
            points = by_rank.get(rank)
            if points is None:
                points = by_rank[rank] = (array.array("d"), array.array("d"))
            points[0].append(step)
            points[1].append(value)
            if len(points[0]) > MAX_POINTS:  # every other one dropped: the plot's resolution
                by_rank[rank] = (points[0][::2], points[1][::2])
