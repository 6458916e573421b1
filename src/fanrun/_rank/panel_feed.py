"""A rank's metric points for the caller's live panel: what the function logs with MLflow, tracked
or not, appended to the rank's file in the run directory, which the caller reads when it redraws.
Only where the caller's panel plots them (ENV_PANEL_METRICS).

A key's points are written at most every WRITE_EVERY_S, the latest one each time: a loop that
logs every step would otherwise have the caller parse thousands of lines a second for a plot a
few hundred pixels wide. flush() writes the points held back, when the function has ended.

Run as a file by tracking.py, like the worker: standard library only.
"""

from __future__ import annotations

import math
import os
import runpy
import time

_contract = runpy.run_path(os.path.join(os.path.dirname(__file__), "contract.py"))

WRITE_EVERY_S = 0.1


class Feed:
    def __init__(self, path: str) -> None:
        self._path = path
        self._held: dict[str, str] = {}  # key -> its latest line not written yet
        self._written_at = -math.inf

    def __call__(self, records) -> None:
        """records: (key, value, timestamp, step, ...), as MLflow's stores get them."""
        for key, value, _, step, *_ in records:
            if "\t" not in key and "\n" not in key and isinstance(value, (int, float)) and math.isfinite(value):
                self._held[key] = f"{key}\t{step or 0}\t{float(value)!r}\n"
        if self._held and time.monotonic() - self._written_at >= WRITE_EVERY_S:
            self.flush()

    def flush(self) -> None:
        lines, self._held = "".join(self._held.values()), {}
        self._written_at = time.monotonic()
        if not lines:
            return
        try:
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # the plot misses these points; the run's metrics are unchanged


def make_feed() -> Feed | None:
    """This rank's Feed; None where the caller's panel plots nothing."""
    run_dir = os.environ.get(_contract["ENV_RUN_DIR"])
    if os.environ.get(_contract["ENV_PANEL_METRICS"]) != "1" or not run_dir:
        return None
    return Feed(os.path.join(run_dir, _contract["panel_metrics_name"](int(os.environ.get("RANK", "0")))))
