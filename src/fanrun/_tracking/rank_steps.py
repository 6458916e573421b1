"""Each rank's step time, and the share of it spent waiting for data and in collectives, as
metrics of the attempt's run: read from the ranks' progress records (_rank/progress.py) in the
attempt's directory, once per system-metrics sample (system_metrics.py), in the agent.

The records are there where the call is watched for stalls (on_stall, on this machine); the
agent learns the directory from the caller once it is made (caller.TrackedCall.use_directory).
Before then, and for a rank without two steps yet, a sample holds none of these metrics.
"""

from __future__ import annotations

from pathlib import Path

from .._rank.contract import progress_name
from .._spec.progress_record import RankProgress, comm_per_step_s, read_collective_waits


def metric_names(rank: int) -> tuple[str, str, str]:
    """The last step's length in seconds, and the fractions of it spent waiting for data and in collectives."""
    return (f"fanrun/rank_{rank}/step_time_s", f"fanrun/rank_{rank}/data_wait_fraction",
            f"fanrun/rank_{rank}/comm_wait_fraction")


class RankSteps:
    """The ranks' last steps, read when a sample asks; nothing before follow() names their directory."""

    def __init__(self) -> None:
        # Set by the agent's main thread, read by the sampler's: one assignment of a tuple.
        self._where: tuple[Path, int] | None = None

    def follow(self, run_dir: Path, world_size: int) -> None:
        self._where = (run_dir, world_size)

    def read(self) -> dict[str, float]:
        """One read of each rank's record: N small files, each a few hundred bytes."""
        where = self._where
        if where is None:
            return {}
        run_dir, world_size = where
        waits = read_collective_waits(run_dir)
        metrics: dict[str, float] = {}
        for rank in range(world_size):
            progress = RankProgress.read(run_dir / progress_name(rank), rank)
            if progress is None or progress.steps < 2 or not progress.step_s > 0:
                continue
            step, data, comm = metric_names(rank)
            metrics[step] = progress.step_s
            metrics[data] = _fraction(progress.step_data_s, progress.step_s)
            # Under DDP no Python collective shows the wait: the flight recorders do (straggler.py).
            metrics[comm] = _fraction(comm_per_step_s(progress, waits.get(rank, 0.0)), progress.step_s)
        return metrics


def _fraction(part: float, whole: float) -> float:
    """Within [0, 1]: a wait that began before the step did (a collective of another thread) is
    counted whole by the rank, and would otherwise read as more than the step."""
    return min(max(part / whole, 0.0), 1.0)
