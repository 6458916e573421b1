"""A remote table's files on this node: whole Parquet files fetched into the node's file cache
(shared by ranks and runs, as VolumeDataset's), ahead of the reader, then read from local disk.
A footer alone is read in place, by range, when the table is opened."""

from __future__ import annotations

import atexit
import weakref

from .. import _core
from ._cache import cache_name, check_cache_limit, engine_fetches, engine_http_options
from ._per_process import PerProcess
from ._table_deadline import waits_named

# Files each reader asks the cache for ahead of the one it reads.
PREFETCH_FILES = 2


class ArrowFetch:
    """Writes one remote file to a local path through the table's pyarrow filesystem; called by
    the cache's native threads for every source the engine does not fetch itself."""

    def __init__(self, filesystem, paths: dict[str, str], fetch_timeout: float | None) -> None:
        self._filesystem = filesystem  # its requests already limited by fetch_timeout (_table_store.py)
        self._paths = paths  # source URL -> path on the filesystem
        self._fetch_timeout = fetch_timeout

    def __call__(self, source: str, partial_path: str) -> None:
        # A timeout is raised as TimeoutError, which the cache names as the fetch's deadline.
        with waits_named("The fetch of", source, self._fetch_timeout, TimeoutError):
            with self._filesystem.open_input_stream(self._paths[source]) as remote, open(partial_path, "wb") as local:
                while chunk := remote.read(4 << 20):
                    local.write(chunk)


class RemoteFiles:
    """The cache's side of a TableSource whose files are remote: acquire() a file's local copy,
    release() it, prefetch() the next ones. The cache is made in each process that reads."""

    def __init__(self, filesystem, files: list, sizes: list[int], cache_dir: str, cache_limit: int,
                 storage_options: dict, endpoint: str, fetch_timeout: float | None) -> None:
        """cache_dir has been checked to be the caller's alone. `endpoint` names the store where
        its URLs do not (an S3-compatible one's s3://bucket/key): part of the files' cache names.
        fetch_timeout bounds each attempt at a file, as VolumeDataset's."""
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        self.sources = [f.source for f in files]
        self._names = [cache_name(f"{endpoint} {f.source}" if endpoint else f.source) for f in files]
        self.sizes = sizes
        self._fetch = ArrowFetch(filesystem, {f.source: f.path for f in files}, fetch_timeout)
        self._fetch_timeout = fetch_timeout
        self._native_http = bool(self.sources) and engine_fetches(self.sources[0], storage_options)
        self._prefetched: set[int] = set()
        self._cache = PerProcess(self._make_cache)

    def check_limit(self, readers: int, files_held: int) -> None:
        check_cache_limit(self.cache_limit, readers, files_held + PREFETCH_FILES, max(self.sizes, default=0),
                          PREFETCH_FILES)

    def acquire(self, index: int) -> str:
        """The local path of file `index`, fetched if it is not cached; held until release(index)."""
        return self._cache.get().acquire(self.sources[index], self._names[index], self.sizes[index])

    def release(self, index: int) -> None:
        self._cache.get().release(self._names[index])

    def prefetch(self, indices: list[int]) -> None:
        cache = self._cache.get()
        for index in indices:
            if index not in self._prefetched:
                self._prefetched.add(index)
                cache.prefetch(self.sources[index], self._names[index], self.sizes[index])

    def _make_cache(self) -> _core.FileCache:
        self._prefetched = set()
        cache = _core.FileCache(self.cache_dir, self.cache_limit, 4, 3, self._fetch, native_http=self._native_http,
                                **engine_http_options(self._fetch_timeout, None))
        atexit.register(_close_cache, weakref.ref(cache))
        return cache

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_cache"]  # its native threads stay in the process that made them
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._cache = PerProcess(self._make_cache)


def _close_cache(reference: weakref.ref) -> None:
    cache = reference()
    if cache is not None:
        cache.close()  # joins its threads before the interpreter stops answering them
