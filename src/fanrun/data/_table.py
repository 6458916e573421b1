"""TableDataset: the rows of a Delta Lake or Parquet table, split across ranks and DataLoader
workers without a sampler (_table_split.py), resumable mid-epoch with any world size."""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch.utils.data

from . import _split, _table_split
from ._dataset import _rank_and_world
from ._cache import check_fetch_timeout, default_cache_dir, parse_byte_size
from ._passes import CountedPasses
from ._table_batch import to_columns
from ._table_remote import PREFETCH_FILES
from ._table_source import OPEN_FILES, TableSource

_STATE_VERSION = 1


class TableDataset(CountedPasses, torch.utils.data.IterableDataset):
    """The rows of the table at `uri`, each yielded once per epoch across all ranks and workers.

    uri: a Delta table (a folder with ``_delta_log``), a Parquet file, or a folder of them (hive
        partitions such as ``day=2026-11-30/`` become columns); a local path, or a URL of a
        filesystem pyarrow knows (``s3://``, ``gs://``, ``hdfs://``).
    columns: the columns to read (default: all).
    filter: a pyarrow expression on any columns (``pyarrow.compute.field("day") >= "2026-11-01"``,
        ``pyarrow.compute.field("label") == 3``): only the rows it passes are read. Files whose
        partition values it rules out are never opened; where it names other columns, the row
        groups their statistics do not rule out have those columns read once, when the table
        is opened, to count the rows that pass (docs/tables.md, Filters).
    version: a Delta table's version (default: the latest).
    format: "rows": each item is a row, a dict of column to Python value. "torch": each item
        is a batch of up to batch_rows rows, a dict of column to a tensor (integer, float and
        boolean columns without nulls, and fixed-size lists of numbers) or to a list of Python
        values (any other column). From DataLoader workers, a batch's tensors reach the rank
        in one shared-memory block, never pickled. By default "torch" if batch_rows is given,
        else "rows".
    batch_rows: rows per batch of format="torch" (default DEFAULT_BATCH_ROWS). Larger batches
        deliver more rows a second: each batch costs the DataLoader a fixed hand-over.
    shuffle, seed: each epoch orders the table's row groups by a permutation drawn from
        (seed, epoch); set_epoch() picks it. Rows within a row group keep their order.
    drop_last: every rank reads the same number of rows per epoch; by default a few (fewer than
        the world size) are repeated to make it so, with drop_last=True a few are left out.
    storage_options: a remote table's credentials and client settings, in deltalake's keys
        (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...): for deltalake (a Delta table's log),
        for pyarrow's S3 filesystem (an ``s3://`` table's files), and for fsspec (URLs pyarrow
        has no filesystem of its own for, such as ``http://``).
    cache_dir, cache_limit: where a remote table's files are cached on this node, whole, as
        VolumeDataset caches files (shared by ranks and runs; by default fanrun/data under
        ``$XDG_CACHE_HOME`` or ``~/.cache``), and the most bytes kept there (None: no limit).
        Each reader fetches the next files of its part while it reads one.
    fetch_timeout: seconds each request to a remote table's store may take (None: its client's
        own limit), as VolumeDataset's: the listing's, the log's, the footers' and each attempt
        at a file's. One past it is a TableError naming the URL, the limit and the time waited
        (docs/tables.md, Remote tables).
    """

    def __init__(self, uri: str, columns: Sequence[str] | None = None, filter: Any = None, version: int | None = None,
                 batch_rows: int | None = None, format: str | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, fetch_timeout: float | None = 3600.0) -> None:
        super().__init__()
        check_fetch_timeout(fetch_timeout)
        if batch_rows is not None and (isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1):
            raise ValueError(f"batch_rows must be a positive number of rows or None, not {batch_rows!r}")
        batch_rows = _batch_rows_of(format, batch_rows)
        self.source = TableSource(uri, columns=columns, filter=filter, version=version, storage_options=storage_options,
                                  cache_dir=os.fspath(cache_dir) if cache_dir is not None else default_cache_dir(),
                                  cache_limit=parse_byte_size(cache_limit), fetch_timeout=fetch_timeout)
        self.fetch_timeout = fetch_timeout
        self.batch_rows = batch_rows
        self.format = "rows" if batch_rows is None else "torch"
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._work: list[tuple[int, int]] | None = None  # a loaded state's: the rest of its epoch
        self._resume_pending = False
        self._chunk = 1  # items in each of the DataLoader's batches, set by fanrun.data.DataLoader
        self._pass: tuple[list[tuple[int, int]], int, int] | None = None  # work, world size, items per loader batch
        self._check_limit(num_workers=0)  # before any work; the workers check again knowing their number

    # ------------------------------------------------------------ public

    @property
    def columns(self) -> list[str]:
        return list(self.source.columns)

    @property
    def num_rows(self) -> int:
        """Rows in the table (those its deletion vectors and the filter leave)."""
        return self.source.num_rows

    def set_epoch(self, epoch: int) -> None:
        """Chooses the epoch's order; a state just loaded for this epoch resumes it."""
        if self._resume_pending and epoch == self._epoch:
            return
        self._epoch = epoch
        self._work = None
        self._resume_pending = False
        self._pass = None
        self._consumed = 0

    def state_dict(self) -> dict:
        """What this epoch has left to read, as intervals of its order's rows: valid for any world
        size and any num_workers. Call it on any rank once every rank has consumed the same
        number of items (as after the same number of DDP steps); rank 0's is enough. With
        DataLoader workers, iterate through fanrun.data.DataLoader, which counts what the main
        process received."""
        if self._pass is None:
            remaining = self._current_work()
        else:
            work, world_size, _ = self._pass
            remaining = _table_split.remaining_after(work, world_size, self.drop_last,
                                                     self._consumed * self._rows_per_item())
        return {"version": _STATE_VERSION, "epoch": self._epoch, "remaining": [list(i) for i in remaining],
                "num_rows": self.num_rows, "num_pieces": len(self.source.pieces), "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at `state`: the next pass reads exactly the rows of that epoch not yet consumed."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"Not a TableDataset state of version {_STATE_VERSION}: {state!r}")
        now = {"num_rows": self.num_rows, "num_pieces": len(self.source.pieces), "seed": self.seed, "shuffle": self.shuffle}
        mismatches = [f"{key}: saved {state[key]!r}, now {value!r}" for key, value in now.items() if state[key] != value]
        if mismatches:
            raise ValueError("The state was saved for another table or order, so its rows would not be the same ("
                             + "; ".join(mismatches) + ")")
        work = [(int(a), int(b)) for a, b in state["remaining"]]
        if any(not 0 <= a < b <= self.num_rows for a, b in work):
            raise ValueError(f"The state's intervals {state['remaining']!r} are not within 0..{self.num_rows}")
        self._epoch = int(state["epoch"])
        self._work = work
        self._resume_pending = True
        self._pass = None
        self._consumed = 0

    def __len__(self) -> int:
        """Items this rank reads in the next pass."""
        _, world_size = _rank_and_world()
        rows = _table_split.per_rank_count(_table_split.total(self._current_work()), world_size, self.drop_last)
        return -(-rows // self._rows_per_item())

    def __iter__(self) -> Iterator[Any]:
        in_worker = self._own_pass()
        info = torch.utils.data.get_worker_info()
        rank, world_size = _rank_and_world()
        if in_worker and not self._loader_counts:
            # A worker of torch's own DataLoader: no pass was begun in the main process, whose
            # batch size this process does not know. Its workers take contiguous parts of the
            # rank's span, each of whole items, so each reads its row groups once.
            work, per_batch = self._current_work(), None
        else:
            work, world_size, per_batch = self._pass
        span, _ = _table_split.rank_span(work, rank, world_size, self.drop_last)
        if info is not None:
            self._check_limit(num_workers=info.num_workers)
            rows = _table_split.total(span)
            if per_batch is None:
                items = -(-rows // self._rows_per_item())
                per_batch = max(1, -(-items // info.num_workers))
            span = _table_split.worker_part(span, rows, info.id, info.num_workers, per_batch * self._rows_per_item())
        yield from self._counted(self._items(span))

    # ------------------------------------------------------------ fanrun.data.DataLoader's hooks

    def _begin_pass(self, by_loader: bool = False, num_workers: int = 0) -> None:
        self._loader_counts = by_loader
        _, world_size = _rank_and_world()
        # Without a loader, the main process reads the rank's whole span, one item at a time.
        self._pass = (self._current_work(), world_size, self._chunk if by_loader else 1)
        self._consumed = 0

    def _pass_started(self) -> None:
        self._work = None  # later passes are whole epochs
        self._resume_pending = False

    # ------------------------------------------------------------ reading

    def _rows_per_item(self) -> int:
        return self.batch_rows or 1

    def _check_limit(self, num_workers: int) -> None:
        if self.source.remote is not None:
            readers = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * max(1, num_workers)
            self.source.remote.check_limit(readers, OPEN_FILES)

    def _current_work(self) -> list[tuple[int, int]]:
        return self._work if self._work is not None else ([(0, self.num_rows)] if self.num_rows else [])

    def _order(self) -> tuple[list[int], list[int]]:
        """The epoch's pieces in order, and where each one's rows start along it."""
        order = _split.permutation(len(self.source.pieces), self.seed, self._epoch, self.shuffle)
        starts = list(itertools.accumulate((self.source.pieces[i].rows for i in order), initial=0))
        return order, starts

    def _items(self, intervals: list[tuple[int, int]]) -> Iterator[Any]:
        try:
            yield from self._read_items(intervals)
        finally:
            self.source.close_files()  # a remote table's files are then the cache's to evict

    def _read_items(self, intervals: list[tuple[int, int]]) -> Iterator[Any]:
        order, starts = self._order()
        in_turn = _files_in_turn(intervals, order, starts, self.source.pieces)
        files = {file: position for position, file in enumerate(in_turn)}
        pending = None  # rows of a batch that continues in the next piece
        held: tuple[int, Any] = (-1, None)  # the row group in use, read once for all its intervals
        for a, b in intervals:
            position = a
            while position < b:
                at = bisect.bisect_right(starts, position) - 1
                end = min(b, starts[at + 1])
                if held[0] != at:
                    piece = self.source.pieces[order[at]]
                    ahead = files[piece.file] + 1
                    self.source.prefetch(in_turn[ahead:ahead + PREFETCH_FILES])
                    held = (at, self.source.read(piece))
                table = held[1].slice(position - starts[at], end - position)
                position = end
                if self.batch_rows is None:
                    yield from table.to_pylist()
                    continue
                if pending is not None:
                    import pyarrow as pa

                    table = pa.concat_tables([pending, table])
                cut = table.num_rows - table.num_rows % self.batch_rows
                for start in range(0, cut, self.batch_rows):
                    yield to_columns(table.slice(start, self.batch_rows))
                pending = table.slice(cut) if cut < table.num_rows else None
        if pending is not None:
            yield to_columns(pending)


DEFAULT_BATCH_ROWS = 1024
FORMATS = ("rows", "torch")


def _batch_rows_of(format: str | None, batch_rows: int | None) -> int | None:
    """The rows of each item: None for format="rows", a number for format="torch"."""
    if format is None:
        return batch_rows
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, FORMATS))}, not {format!r}")
    if format == "rows":
        if batch_rows is not None:
            raise ValueError(f"format='rows' yields one row at a time, so batch_rows={batch_rows} has no meaning there: "
                             "leave batch_rows out, or ask for format='torch'")
        return None
    return batch_rows or DEFAULT_BATCH_ROWS


def _files_in_turn(intervals: list[tuple[int, int]], order: list[int], starts: list[int], pieces: list) -> list[int]:
    """The files the intervals' rows come from, each once, in the order they are first read."""
    files: dict[int, None] = {}
    for a, b in intervals:
        for at in range(bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, b)):
            files.setdefault(pieces[order[at]].file)
    return list(files)
