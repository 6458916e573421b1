"""DataLoader: torch's, measuring how long each step waits for data, and counting what the
main process received so that a VolumeDataset's state_dict() is exact with workers."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from ._dataset import VolumeDataset


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader, plus:

    - `wait_seconds`, `step_seconds` and `stalled_fraction` of the last pass: the time
      spent waiting for the next batch, the whole time of the pass, and their ratio. A
      fraction near 1 means input is the bottleneck.
    - inside a tracked fanrun call, the fraction and the wait are logged at the end of each
      pass to the call's MLflow run, as ``data/stalled_fraction/rank_<RANK>`` and
      ``data/wait_seconds/rank_<RANK>`` with the pass number as step.
    - with a VolumeDataset: workers read whole batches in turn, and the batches the main
      process received are counted, so `dataset.state_dict()` resumes exactly.
      persistent_workers=True is refused there: workers kept between epochs would not see
      set_epoch() or load_state_dict().
    """

    def __init__(self, dataset, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._volume = dataset if isinstance(dataset, VolumeDataset) else None
        if self._volume is not None:
            if self.persistent_workers:
                raise ValueError(
                    "fanrun.data.DataLoader: persistent_workers=True cannot be used with a VolumeDataset: "
                    "workers kept between epochs never see set_epoch() or load_state_dict(). Leave it False."
                )
            self._volume._chunk = self.batch_size or 1
        self.wait_seconds = 0.0
        self.step_seconds = 0.0
        self.stalled_fraction = 0.0
        self._passes = 0

    def __iter__(self) -> Iterator[Any]:
        volume = self._volume
        if volume is not None:
            volume._begin_pass(by_loader=True)
        iterator = super().__iter__()  # workers start here, with the pass's start offset
        if volume is not None:
            volume._pass_started()
        batch_size = self.batch_size or 1
        wait = 0.0
        started = time.perf_counter()
        try:
            while True:
                before = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                wait += time.perf_counter() - before
                if volume is not None:
                    volume._count_consumed(batch_size)
                yield batch
        finally:
            if volume is not None:
                volume._end_pass()
            total = time.perf_counter() - started
            self.wait_seconds = wait
            self.step_seconds = total
            self.stalled_fraction = wait / total if total > 0 else 0.0
            self._passes += 1
            _log_to_run(self.stalled_fraction, wait, self._passes)


def _log_to_run(stalled_fraction: float, wait_seconds: float, step: int) -> None:
    # Only inside a tracked call, where fanrun made the call's run this rank's active run.
    if not os.environ.get("FANRUN_MLFLOW_RUN_ID"):
        return
    try:
        import mlflow

        rank = os.environ.get("RANK", "0")
        mlflow.log_metrics(
            {f"data/stalled_fraction/rank_{rank}": stalled_fraction, f"data/wait_seconds/rank_{rank}": wait_seconds},
            step=step,
        )
    except Exception as error:  # a tracking server that fails must not fail the training
        print(f"fanrun.data: could not log data-wait metrics to MLflow ({type(error).__name__}: {error})", file=sys.stderr)
