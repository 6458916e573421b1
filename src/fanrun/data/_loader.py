"""DataLoader: torch's, measuring how long each step waits for data, and counting what the
main process received so that a VolumeDataset's state_dict() is exact with workers."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from .._rank import tracking as rank_tracking
from ._dataset import VolumeDataset
from ._table import TableDataset
from ._first_batches import FirstBatchTurns


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader, plus:

    - `wait_seconds`, `step_seconds` and `stalled_fraction` of the last pass: the time
      spent waiting for the next batch, the whole time of the pass, and their ratio. A
      fraction near 1 means input is the bottleneck.
    - inside a tracked fanrun call, the fraction and the wait are logged at the end of each
      pass to the call's MLflow run, as ``data/stalled_fraction/rank_<RANK>`` and
      ``data/wait_seconds/rank_<RANK>`` with the pass number as step.
    - with a VolumeDataset or a TableDataset: workers read whole batches in turn, and the
      batches the main process received are counted, so `dataset.state_dict()` resumes exactly. Forked
      workers also make their first batches in turn, so that the first batch does not
      share the bandwidth with every other worker's (see _first_batches.py).
      persistent_workers=True is refused there: workers kept between epochs would not see
      set_epoch() or load_state_dict().
    """

    def __init__(self, dataset, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._volume = dataset if isinstance(dataset, (VolumeDataset, TableDataset)) else None
        if self._volume is not None:
            if self.persistent_workers:
                raise ValueError(
                    f"fanrun.data.DataLoader: persistent_workers=True cannot be used with a {type(dataset).__name__}: "
                    "workers kept between epochs never see set_epoch() or load_state_dict(). Leave it False."
                )
            self._volume._chunk = self.batch_size or 1
        if self.collate_fn is _DEFAULT_CONVERT:
            # A TableDataset's batches are tensors and lists already: there is nothing to convert.
            tables = isinstance(dataset, TableDataset) and dataset.batch_rows is not None
            self.collate_fn = _unchanged if tables else _default_convert
        if self.num_workers > 0:
            self.collate_fn = _SmallTensorsByValue(self.collate_fn)
        self.wait_seconds = 0.0
        self.step_seconds = 0.0
        self.stalled_fraction = 0.0
        self._passes = 0

    def _forks_workers(self) -> bool:
        """Whether the workers are forked, and so inherit the first-batch turns' pipes."""
        context = self.multiprocessing_context  # torch keeps a context object, or None
        if context is not None:
            return context.get_start_method() == "fork"
        # Asked without fixing the default, which the program may still set itself; the
        # first method listed is the default one.
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        return method == "fork"

    def __iter__(self) -> Iterator[Any]:
        volume = self._volume
        if volume is not None:
            volume._begin_pass(by_loader=True, num_workers=self.num_workers)
            if self.num_workers > 1 and self._forks_workers() and isinstance(volume, VolumeDataset):
                volume._turns = FirstBatchTurns(self.num_workers)
        try:
            iterator = super().__iter__()  # workers start here, with the pass's start offset
        finally:
            if isinstance(volume, VolumeDataset) and volume._turns is not None:
                volume._turns.close()  # the workers hold their own ends now
                volume._turns = None
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


_DEFAULT_CONVERT = torch.utils.data.default_convert

# Below this size a tensor crosses from a worker to the main process inside the pickled
# batch; above it, through shared memory as torch sends every tensor.
SMALL_TENSOR_BYTES = 256 * 1024


class _SmallTensorsByValue:
    """A collate_fn, then each small tensor of the batch marked to travel by value.

    torch moves every tensor a worker returns into a shared-memory segment of its own and
    passes its descriptor to the main process through a socket: about 0.3 ms of CPU in each
    process for each tensor, whatever its size. For the labels, lengths and indices of a
    batch that is most of what the transfer costs. The marked tensors are rebuilt as plain
    tensors while the main process unpickles the batch, so the batch the loop gets is the same.
    """

    def __init__(self, collate_fn) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples):
        return _mark_small(self.collate_fn(samples))


# Plain element types only: taking the bytes of a quantized tensor crashed the process.
_BY_VALUE_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})


_PLAIN_VALUES = frozenset({str, bytes, int, float, bool, type(None)})


def _is_plain_list(value) -> bool:
    """A list or tuple of plain values only (a batch's strings): their types are found at C
    speed, where visiting the values one by one cost more than reading the rows."""
    return _PLAIN_VALUES.issuperset(set(map(type, value)))


def _default_convert(data):
    """torch's default_convert (the collate_fn of batch_size=None), with a list of plain
    values copied whole: torch's converts each value in a call of its own, which for the
    strings of a batch read from a table cost more than reading them."""
    if type(data) is dict:
        return {key: _default_convert(value) for key, value in data.items()}
    if type(data) is list and _is_plain_list(data):
        return list(data)
    return _DEFAULT_CONVERT(data)


def _mark_small(value):
    if type(value) is torch.Tensor:
        if (value.dtype in _BY_VALUE_DTYPES and value.layout == torch.strided and value.device.type == "cpu"
                and not value.requires_grad and value.nelement() * value.element_size() <= SMALL_TENSOR_BYTES):
            return _ByValue(value)
        return value
    if type(value) in (list, tuple):
        if _is_plain_list(value):
            return value  # taken whole, not rebuilt value by value
        return type(value)(_mark_small(v) for v in value)
    if type(value) is dict:
        return {k: _mark_small(v) for k, v in value.items()}
    return value  # other containers (namedtuples, a user's batch classes) travel as torch sends them


class _ByValue:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self):
        # Runs in the worker's queue thread, where an exception would be printed and the
        # batch never sent, leaving the main process waiting: a tensor whose bytes cannot
        # be taken goes as torch sends it.
        try:
            t = self.tensor.resolve_conj().resolve_neg().contiguous()
            return _tensor_from_bytes, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape))
        except Exception:
            return _unchanged, (self.tensor,)


def _unchanged(value):
    return value


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _log_to_run(stalled_fraction: float, wait_seconds: float, step: int) -> None:
    # Only inside a tracked call, where importing mlflow makes the call's run this rank's active run.
    if os.environ.get(rank_tracking.VARIABLE, rank_tracking.OFF) == rank_tracking.OFF:
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
