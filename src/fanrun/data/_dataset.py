"""VolumeDataset: the files of a volume or a bucket, split across ranks and DataLoader
workers without a sampler, cached on the node by the native engine, resumable mid-epoch."""

from __future__ import annotations

import atexit
import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.utils.data

from .. import _core
from .._errors import DataFileError, FanrunError
from . import _split
from ._cache import (
    FsspecFetch,
    cache_name,
    check_cache_limit,
    default_cache_dir,
    engine_fetches,
    engine_http_options,
    native_http_allowed,
    open_cache_dir,
    parse_byte_size,
)
from ._dataset_source import SourceFile, shared_listing
from ._first_batches import FirstBatchTurns, Turn
from ._passes import CountedPasses
from ._per_process import PerProcess

_STATE_VERSION = 1


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _close_cache(reference: weakref.ref) -> None:
    cache = reference()
    if cache is not None:
        cache.close()  # joins its threads before the interpreter stops answering them


class VolumeDataset(CountedPasses, torch.utils.data.IterableDataset):
    """The files under `source`, each yielded once per epoch across all ranks and workers
    as a local path, or as `transform(path)`.

    source: a local or mounted directory or file, a list of them, or an fsspec URL
        (``http(s)://``, ``s3://``, ``gs://``; fsspec and its filesystem's package needed).
    pattern: fnmatch pattern on each file's path relative to its source root (``*.jpg``).
    shuffle, seed: each epoch is a permutation drawn from (seed, epoch); set_epoch() picks it.
    drop_last: every rank reads the same number of samples per epoch; by default the last
        few are padded with repeats of the epoch's first remaining files (fewer than the world
        size), with drop_last=True they are left out instead.
    cache_dir, cache_limit: where remote files are cached on this node (shared by ranks,
        workers and later runs) and how large it may grow (``"20GB"``; None: unbounded). By
        default ``$FANRUN_CACHE_DIR``, or ``fanrun/data`` under ``$XDG_CACHE_HOME`` or
        ``~/.cache``; a directory another user owns or can write is refused
        (UnsafePathError).
    cache_local: also copy local files into the cache (for slow mounts); by default local
        files are read in place.
    prefetch: files each reader fetches ahead of the one it yields: into the cache, or for
        local files read in place, into the page cache (fewer of them for files of several
        MB: as many as 16 MiB holds, at least one). 0: none.
    retries: attempts per file after the first; skip_unreadable: leave out files that
        still fail, counted in `skipped_files`, instead of raising DataFileError.
    fetch_timeout, min_fetch_rate: limits of each attempt at an http(s):// file: seconds in all
        (None: no deadline), and (bytes per second, seconds): slower than that for that long
        fails (None: no minimum). A fetch that fails them is an attempt that failed. Each
        request of an http(s):// listing, or for a file's size, has fetch_timeout seconds too
        (None: aiohttp's own 300 s); one past it is a DataSourceError naming the URL.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str | os.PathLike],
        pattern: str | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | str | None = None,
        transform: Callable[[str], Any] | None = None,
        drop_last: bool = False,
        cache_local: bool = False,
        prefetch: int = 8,
        cache_threads: int = 4,
        retries: int = 2,
        skip_unreadable: bool = False,
        storage_options: dict | None = None,
        fetch_timeout: float | None = 3600.0,
        min_fetch_rate: tuple[int, float] | None = (1024, 60.0),
    ) -> None:
        super().__init__()
        if prefetch < 0 or cache_threads < 1 or retries < 0:
            raise ValueError(
                f"prefetch must be >= 0, cache_threads >= 1 and retries >= 0, "
                f"not {prefetch}, {cache_threads} and {retries}"
            )
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, not {type(transform).__name__}")
        self.shuffle = shuffle
        self.seed = seed
        self.transform = transform
        self.drop_last = drop_last
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_limit = parse_byte_size(cache_limit)
        self.cache_local = cache_local
        self.prefetch = prefetch
        self.cache_threads = cache_threads
        self.retries = retries
        self.skip_unreadable = skip_unreadable
        self.storage_options = dict(storage_options or {})
        self._http_options = engine_http_options(fetch_timeout, min_fetch_rate)
        self.fetch_timeout = fetch_timeout
        cache_dir_fd = open_cache_dir(self.cache_dir)  # refused here, before any work, if not the caller's alone
        try:
            self._files: list[SourceFile] = shared_listing(source, pattern, self.storage_options, self.cache_dir,
                                                           cache_dir_fd, fetch_timeout)
        finally:
            os.close(cache_dir_fd)
        self._cached = [self._is_cached(f) for f in self._files]
        self._native_http = native_http_allowed(self.storage_options)
        remote = next((f.source for f in self._files if not f.local), None)
        # The engine fetches http(s):// itself: only other sources need fsspec in the workers.
        if remote is not None and not engine_fetches(remote, self.storage_options):
            _import_filesystem(remote)
        self.skipped_files: list[str] = []
        self._epoch = 0
        self._next_offset = 0  # where the next pass of this epoch starts
        self._resume_pending = False
        self._chunk = 1  # the DataLoader's batch size, set by fanrun.data.DataLoader
        self._pass: tuple[int, int, int] | None = None  # (start offset, world size, per-rank count)
        self._consumed = 0
        self._own_engine_parts()
        self._turns: FirstBatchTurns | None = None  # set by fanrun.data.DataLoader while it forks its workers
        self._check_limit(num_workers=0)  # before any work; the workers check again knowing their number

    # ------------------------------------------------------------ public

    @property
    def files(self) -> list[str]:
        """Every file of the dataset, sorted: local paths or URLs."""
        return [f.source for f in self._files]

    def set_epoch(self, epoch: int) -> None:
        """Chooses the epoch's permutation; a state just loaded for this epoch resumes it."""
        if self._resume_pending and epoch == self._epoch:
            return
        self._epoch = epoch
        self._next_offset = 0
        self._resume_pending = False
        self._pass = None
        self._consumed = 0

    def state_dict(self) -> dict:
        """Where this epoch stands, as a global offset into its permutation: valid for any
        world size and any num_workers. Call it on any rank when every rank has consumed the
        same number of samples (as after the same number of DDP steps); rank 0's is enough.
        With DataLoader workers, iterate through fanrun.data.DataLoader, which counts what the
        main process received."""
        if self._pass is None:
            offset = self._next_offset
        else:
            start, world_size, count = self._pass
            if self._consumed >= count:
                offset = len(self._files)  # this epoch is done; padding and dropped files included
            else:
                offset = _split.offset_after(start, self._consumed, world_size, len(self._files))
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "offset": offset,
            "num_files": len(self._files),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resumes at `state`: the next pass (after set_epoch(state's epoch), or without one)
        reads exactly the samples of that epoch not yet consumed when it was saved."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"Not a VolumeDataset state of version {_STATE_VERSION}: {state!r}")
        mismatches = [
            f"{key}: saved {state[key]!r}, now {now!r}"
            for key, now in (("num_files", len(self._files)), ("seed", self.seed), ("shuffle", self.shuffle))
            if state[key] != now
        ]
        if mismatches:
            raise ValueError(
                "The state was saved for another dataset, so its offset would not name the same samples ("
                + "; ".join(mismatches) + ")"
            )
        if not 0 <= state["offset"] <= len(self._files):
            raise ValueError(f"The state's offset {state['offset']} is outside 0..{len(self._files)}")
        self._epoch = int(state["epoch"])
        self._next_offset = int(state["offset"])
        self._resume_pending = True
        self._pass = None
        self._consumed = 0

    def __len__(self) -> int:
        """Samples this rank reads in the next pass."""
        _, world_size = _rank_and_world()
        return _split.per_rank_count(len(self._files) - self._next_offset, world_size, self.drop_last)

    def __iter__(self) -> Iterator[Any]:
        in_worker = self._own_pass()
        info = torch.utils.data.get_worker_info()
        start = self._next_offset if in_worker else self._pass[0]
        rank, world_size = _rank_and_world()
        order = _split.permutation(len(self._files), self.seed, self._epoch, self.shuffle)
        entries = _split.rank_entries(order, start, rank, world_size, self.drop_last)
        turn = None
        if info is not None:
            self._check_limit(num_workers=info.num_workers)
            entries = _split.worker_entries(entries, info.id, info.num_workers, self._chunk)
            if self._turns is not None and self._turns.owner == os.getppid():
                turn = self._turns.turn(info.id)
                self._turns = None
        yield from self._counted(self._samples(entries, turn))

    # ------------------------------------------------------------ fanrun.data.DataLoader's hooks

    def _begin_pass(self, by_loader: bool = False, num_workers: int = 0) -> None:
        self._loader_counts = by_loader
        _, world_size = _rank_and_world()
        start = self._next_offset
        self._pass = (start, world_size, _split.per_rank_count(len(self._files) - start, world_size, self.drop_last))
        self._consumed = 0

    def _pass_started(self) -> None:
        # The workers have their copy of the start offset; later passes are whole epochs.
        self._next_offset = 0
        self._resume_pending = False

    # ------------------------------------------------------------ reading

    def _is_cached(self, file: SourceFile) -> bool:
        return not file.local or self.cache_local

    def _files_held(self) -> int:
        # Prefetched ahead, the one in use, and the yielded paths kept until a batch is formed.
        return self.prefetch + 1 + (1 if self.transform is not None else self._chunk)

    def _check_limit(self, num_workers: int) -> None:
        sizes = [f.size for f, cached in zip(self._files, self._cached) if cached]
        if not sizes or min(sizes) < 0:
            return  # nothing cached, or sizes the source did not give
        readers = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * max(1, num_workers)
        check_cache_limit(self.cache_limit, readers, self._files_held(), max(sizes), self.prefetch)

    def _make_cache(self) -> _core.FileCache:
        remote = any(cached and not f.local for f, cached in zip(self._files, self._cached))
        checksums = {f.source: f.md5 for f in self._files if f.md5 is not None}
        fetch = FsspecFetch(self.storage_options, checksums, self.fetch_timeout) if remote else None
        cache = _core.FileCache(self.cache_dir, self.cache_limit, self.cache_threads, self.retries + 1, fetch,
                                native_http=remote and self._native_http, **self._http_options)
        atexit.register(_close_cache, weakref.ref(cache))
        return cache

    def _samples(self, entries: list[int], turn: Turn | None = None) -> Iterator[Any]:
        if turn is not None:
            if self._first_batch_resident(entries):
                turn.pass_on()  # nothing of the disk to share: no reason to wait
                turn = None
            else:
                turn.wait()  # the workers before this one have made their first batches
        files = self._files
        cache = self._cache.get() if any(self._cached[i] for i in entries) else None
        in_place = self.prefetch > 0 and not all(self._cached[i] for i in entries)
        readahead = self._prefetcher.get() if in_place else None
        held: deque[str] = deque()
        keep = 1 if self.transform is not None else self._chunk
        ahead_count = self._ahead_count(entries)
        prefetched = 0
        try:
            for position, index in enumerate(entries):
                if position == self._chunk and turn is not None:
                    turn.release()  # this worker's first batch is made
                # The next files: fetched into the cache, or read ahead into the page cache.
                # Refilled when half of those ahead are read, so that the threads wake once
                # for several files.
                if prefetched - (position + 1) <= ahead_count // 2:
                    to_read_ahead = []
                    while prefetched < min(len(entries), position + 1 + ahead_count):
                        ahead = files[entries[prefetched]]
                        if self._cached[entries[prefetched]]:
                            cache.prefetch(ahead.source, cache_name(ahead.source), ahead.size)
                        elif readahead is not None:
                            to_read_ahead.append(ahead.source)
                        prefetched += 1
                    if to_read_ahead:
                        readahead.hint(to_read_ahead)
                file = files[index]
                if not self._cached[index]:
                    if readahead is not None and file.size >= _core.LocalPrefetcher.READ_THROUGH_BYTES:
                        # Read from the page cache once the prefetcher has read it through:
                        # read alongside it, the disk served smaller requests, more slowly.
                        readahead.wait(file.source)
                    sample = self._read(file, file.source)
                else:
                    name = cache_name(file.source)
                    try:
                        path = cache.acquire(file.source, name, file.size)
                    except FanrunError as error:  # the engine's message names the source and the attempts
                        sample = self._unreadable(file, error, counted=True)
                    else:
                        held.append(name)
                        sample = self._read(file, path)
                if sample is not _SKIPPED:
                    yield sample
                while len(held) > keep:
                    cache.release(held.popleft())
        finally:
            if turn is not None:
                turn.release()  # no first batch to make, or no more
            if cache is not None:
                cache.release_all()

    def _first_batch_resident(self, entries: list[int]) -> bool:
        """Whether the files of this worker's first batch are local, read in place, and already
        in the page cache."""
        first = entries[:self._chunk]
        return bool(first) and all(not self._cached[i] and _core.LocalPrefetcher.resident(self._files[i].source)
                                   for i in first)

    def _ahead_count(self, entries: list[int]) -> int:
        """How many local files are read ahead: `prefetch`, or fewer for large files, as many
        of the largest as _READAHEAD_BYTES holds (at least one): large files read ahead all
        at once share the disk with the one the reader waits for."""
        largest = max((self._files[i].size for i in entries if not self._cached[i]), default=0)
        return min(self.prefetch, max(1, _READAHEAD_BYTES // largest)) if largest > 0 else self.prefetch

    def _read(self, file: SourceFile, path: str) -> Any:
        """transform(path), or the path once it is known to exist; tried again on OSError."""
        attempt = 0
        while True:
            try:
                if self.transform is None:
                    os.stat(path)
                    return path
                return self.transform(path)
            except OSError as error:
                if attempt == self.retries:
                    return self._unreadable(file, error)
            time.sleep(0.05 * 2**attempt)  # back off: a mount or a server may recover
            attempt += 1

    def _unreadable(self, file: SourceFile, error: BaseException, counted: bool = False) -> Any:
        why = str(error) if counted else f"Could not read '{file.source}' after {self.retries + 1} attempts: {error}"
        if not self.skip_unreadable:
            raise DataFileError(why) from error
        self.skipped_files.append(file.source)
        warnings.warn(f"fanrun.data skips '{file.source}': {why}", stacklevel=2)
        return _SKIPPED

    def _own_engine_parts(self) -> None:
        """The cache and the prefetcher, each made in the process that first uses it: their native
        threads do not travel, by fork or by pickle."""
        self._cache: PerProcess[_core.FileCache] = PerProcess(self._make_cache)
        self._prefetcher: PerProcess[_core.LocalPrefetcher] = PerProcess(self._make_prefetcher)

    def _make_prefetcher(self) -> _core.LocalPrefetcher:
        return _core.LocalPrefetcher(self.cache_threads)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_cache"], state["_prefetcher"]
        state["_turns"] = None  # descriptors, only inherited by forking
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._own_engine_parts()


def _import_filesystem(url: str) -> None:
    """Imports the fsspec filesystem of `url` (aiohttp, for HTTP) here, once: DataLoader workers
    forked from this process then start with it, instead of each importing it on its first
    fetch, which took most of the time to the first batch."""
    import fsspec

    protocol, _ = fsspec.core.split_protocol(url)
    fsspec.get_filesystem_class(protocol)


_SKIPPED = object()
# Per reader, for large local files: one 10 MB file ahead of each of 8 readers; three ahead
# read a cold disk no faster (benchmarks/data.py's large files, 2 ranks x 4 workers).
_READAHEAD_BYTES = 16 << 20


# Databricks' name for the same thing, so that code written for it runs unchanged.
UCVolumeDataset = VolumeDataset
