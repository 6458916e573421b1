"""A rank's metric points for the caller's live panel: what the function logs with MLflow, tracked
or not, appended to the rank's file in the run directory, which the caller reads when it redraws.
Only where the caller's panel plots them (ENV_PANEL_METRICS); one write per logging call.

Run as a file by tracking.py, like the worker: standard library only.
"""

from __future__ import annotations

import math
import os
import runpy

_contract = runpy.run_path(os.path.join(os.path.dirname(__file__), "contract.py"))


def make_feed():
    """feed(records) for this rank, records being (key, value, timestamp, step, ...); None where
    the caller's panel plots nothing."""
    run_dir = os.environ.get(_contract["ENV_RUN_DIR"])
    if os.environ.get(_contract["ENV_PANEL_METRICS"]) != "1" or not run_dir:
        return None
    path = os.path.join(run_dir, _contract["panel_metrics_name"](int(os.environ.get("RANK", "0"))))

    def feed(records) -> None:
        lines = "".join(f"{key}\t{step or 0}\t{float(value)!r}\n" for key, value, _, step, *_ in records
                        if "\t" not in key and "\n" not in key and isinstance(value, (int, float)) and math.isfinite(value))
        if not lines:
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # the plot misses these points; the run's metrics are unchanged

    return feed
