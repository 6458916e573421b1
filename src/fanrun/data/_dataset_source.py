"""Listing a dataset's files: local paths, lists of paths, fsspec URLs; once per node per run.

The listing is recursive and sorted. When ranks of one fanrun (or torchrun) run build the same
dataset, the first to take a flock on the listing's lock file lists the source and writes the
result atomically (temporary file, then rename) into listings/ of the cache directory; the others
wait on that lock and read the file. A lock dies with its process, so a rank that crashed while
listing leaves nothing held.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import fnmatch
import gc
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Sequence
from typing import NamedTuple

from .._rank import contract as run_contract
from .._errors import DataSourceError
from .._private_dir import open_private_subdir
from ._cache import CACHE_DIR_REMEDY
from ._fsspec_deadline import deadline_named, with_deadline

# A listing file older than this belongs to a finished run.
_STALE_LISTING_S = 24 * 3600
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


class SourceFile(NamedTuple):
    # A tuple, so that tens of thousands are made and written to JSON quickly.
    source: str  # absolute local path or full URL
    size: int  # bytes; -1 where the source does not say
    local: bool
    md5: str | None = None  # hex, where the store's listing gives a whole-file MD5


def listed_md5(info: dict, protocols: tuple[str, ...]) -> str | None:
    """The whole-file MD5 a store's listing gives, as hex: GCS's `md5Hash` (base64), or S3's
    `ETag` when it is one (a multipart upload's ETag holds a '-' and is not). Other stores'
    ETags (nginx: mtime-size) are not checksums and are not read."""
    if any(p in ("gs", "gcs") for p in protocols) and isinstance(info.get("md5Hash"), str):
        return base64.b64decode(info["md5Hash"]).hex()
    if any(p in ("s3", "s3a") for p in protocols):
        etag = info.get("ETag") or info.get("etag")
        if isinstance(etag, str) and re.fullmatch(r"[0-9a-f]{32}", etag.strip('"')):
            return etag.strip('"')
    return None


def is_remote_source(text: str) -> bool:
    """A source that fsspec lists and the cache fetches: a URL, but not file://, whose files are
    read in place like any local path."""
    return "://" in text and not text.startswith("file://")


def _local_path(text: str) -> str:
    return os.path.abspath(text[len("file://") :] if text.startswith("file://") else text)


def _matcher(pattern: str | None):
    """fnmatchcase for one pattern, compiled once: listings hold tens of thousands of files."""
    if pattern is None:
        return lambda relative: True
    return re.compile(fnmatch.translate(pattern)).match


def _list_local(root: str, pattern: str | None) -> list[SourceFile]:
    path = _local_path(root)
    if not os.path.exists(path):
        raise DataSourceError(f"The dataset source '{path}' does not exist")
    matches = _matcher(pattern)
    if os.path.isfile(path):
        if not matches(os.path.basename(path)):
            return []
        return [SourceFile(path, os.path.getsize(path), True)]
    found = []
    stack = [path]
    skip = len(path.rstrip("/")) + 1  # entry paths all start with the root and a '/'
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=True):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=True):
                    relative = entry.path[skip:]
                    if matches(relative):
                        found.append(SourceFile(entry.path, entry.stat().st_size, True))
    return found


def _list_remote(url: str, pattern: str | None, storage_options: dict, fetch_timeout: float | None) -> list[SourceFile]:
    import fsspec

    # An instance of its own, not fsspec's shared one: see below.
    fs, root = fsspec.core.url_to_fs(url, **{**with_deadline(url, storage_options, fetch_timeout),
                                             "skip_instance_cache": True})
    try:
        with deadline_named("The listing of", url, fetch_timeout, DataSourceError):
            return _list_filesystem(fs, root, url, pattern)
    finally:
        # The filesystem's client session is closed by a finalizer, through fsspec's event
        # loop thread. Left to a later collection, that can happen in a DataLoader worker
        # forked from this process, which has no such thread: there fsspec waited 1 s for
        # it, in every worker, before the first batch. Collected here, it closes at once.
        # list_files runs this with the collector paused, so the filesystem and its
        # cycles are all still in the youngest generation: collecting that one is enough,
        # and costs microseconds where a full collection would walk all of torch's objects.
        del fs
        gc.collect(0)


def _list_filesystem(fs, root: str, url: str, pattern: str | None) -> list[SourceFile]:
    matches = _matcher(pattern)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not fs.exists(root):
        raise DataSourceError(f"The dataset source '{url}' does not exist")
    # Directory first: to HTTP's filesystem any URL that answers is a file.
    if not fs.isdir(root):
        name = root.rstrip("/").rsplit("/", 1)[-1]
        if not matches(name):
            return []
        info = fs.info(root)
        return [SourceFile(fs.unstrip_protocol(root), _size(info), False, listed_md5(info, protocols))]
    found = []
    prefix = root.rstrip("/") + "/"
    # Per-file work stays small: a bucket or a web server lists tens of thousands of files.
    has_checksums = any(p in ("gs", "gcs", "s3", "s3a") for p in protocols)
    full_urls = any(p in ("http", "https") for p in protocols)  # HTTP's paths are whole URLs already
    for path, info in fs.find(root, detail=True).items():
        if info.get("type") == "directory":
            continue
        relative = path[len(prefix) :] if path.startswith(prefix) else path.rsplit("/", 1)[-1]
        if matches(relative):
            file_url = path if full_urls and "://" in path else fs.unstrip_protocol(path)
            if full_urls:
                _check_listed_url(file_url, url)
            found.append(SourceFile(file_url, _size(info), False, listed_md5(info, protocols) if has_checksums else None))
    return found


def _check_listed_url(url: str, root: str) -> None:
    """An entry of an HTTP listing, which the server wrote: a control character in it (a CR or
    LF would end the request's line and add headers of the server's choosing) is refused."""
    found = _CONTROL_CHARACTER.search(url)
    if found is not None:
        raise DataSourceError(
            f"The listing of '{root}' has an entry with a control character ({found.group()!r}) in its URL: {url!r}. "
            "fanrun does not fetch such a URL: rename the file on the server, or choose the files with `pattern`"
        )


def _size(info: dict) -> int:
    size = info.get("size")
    return int(size) if isinstance(size, int) and size >= 0 else -1


def list_files(source: str | os.PathLike | Sequence[str | os.PathLike], pattern: str | None, storage_options: dict,
               fetch_timeout: float | None = None) -> list[SourceFile]:
    """Every file of the source that matches `pattern` (fnmatch, on the path relative to the
    root it was found under), sorted by its full path or URL; each of an http(s) server's
    answers within `fetch_timeout` seconds."""
    roots = [os.fspath(source)] if isinstance(source, (str, os.PathLike)) else [os.fspath(s) for s in source]
    if not roots:
        raise DataSourceError("The dataset source is an empty list of paths")
    found: dict[str, SourceFile] = {}
    with _collector_paused():
        for root in roots:
            listed = (_list_remote(root, pattern, storage_options, fetch_timeout) if is_remote_source(root)
                      else _list_local(root, pattern))
            for file in listed:
                found[file.source] = file
    if not found:
        where = ", ".join(f"'{r}'" for r in roots)
        what = f"no file matching the pattern '{pattern}'" if pattern is not None else "no file"
        raise DataSourceError(f"The dataset source {where} holds {what}")
    return [found[key] for key in sorted(found)]


@contextlib.contextmanager
def _collector_paused():
    """A listing makes tens of thousands of tuples (and fsspec's, as many dicts), none of them
    in a cycle; with torch imported, the cyclic collector that their allocation sets off would
    walk all of torch's objects several times, which took longer than the listing itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_token() -> str | None:
    """What all ranks of one run share, and nothing else does."""
    for name in (run_contract.ENV_RUN_ID, "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(name)
        if value:
            return f"{name}={value}"
    return None


def shared_listing(
    source, pattern: str | None, storage_options: dict, cache_dir: str, cache_dir_fd: int,
    fetch_timeout: float | None = None,
) -> list[SourceFile]:
    """list_files, done by one process of the run on this node and read by the others."""
    listed = once_per_run([repr(source), pattern], lambda: list_files(source, pattern, storage_options, fetch_timeout),
                          cache_dir, cache_dir_fd)
    with _collector_paused():
        return list(map(SourceFile._make, listed))


def once_per_run(key_parts: list, compute, cache_dir: str, cache_dir_fd: int):
    """compute(), done by one process of the run on this node, its result (JSON-able) read back
    by the others: lists stand for tuples there. The result and its lock are in listings/ of
    the cache directory (open as cache_dir_fd, already checked to be the caller's alone),
    opened there without following links, and private."""
    token = _run_token()
    if token is None:
        return compute()
    key = hashlib.sha256(json.dumps([token, *key_parts], sort_keys=True, default=repr).encode()).hexdigest()[:32]
    directory = open_private_subdir(cache_dir_fd, "listings", cache_dir, what="The cache directory",
                                    remedy=CACHE_DIR_REMEDY)
    try:
        lock = _open_own(key + ".lock", os.O_RDWR | os.O_CREAT, directory)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
            found = _read_listing(key + ".json", directory)
            if found is not None:
                return found
            result = compute()
            _write_listing(key + ".json", result, directory)
        finally:
            os.close(lock)
        _remove_stale_listings(directory)
        return result
    finally:
        os.close(directory)


def _open_own(name: str, flags: int, directory: int) -> int:
    """Opens a file of fanrun's own in `directory`, 0600 where it is made; a link in its place
    is removed, never followed."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, 0o600, dir_fd=directory)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
    os.unlink(name, dir_fd=directory)
    return os.open(name, flags, 0o600, dir_fd=directory)


def _read_listing(name: str, directory: int):
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None  # not fanrun's: replaced when the listing is written
        raise
    with os.fdopen(fd) as file, _collector_paused():
        return json.load(file)


def _write_listing(name: str, result, directory: int) -> None:
    """Written whole to a temporary file, then renamed over `name`: readers see all or nothing."""
    temporary = f"{name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary, dir_fd=directory)  # left by a process of the same pid that died
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=directory)
    with os.fdopen(fd, "w") as file:
        file.write(json.dumps(result, separators=(",", ":")))
    os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)


def _remove_stale_listings(directory: int) -> None:
    """Removes listings (and their locks and temporary files) of finished runs: only files of
    the names fanrun gives them."""
    cutoff = time.time() - _STALE_LISTING_S
    for entry in os.scandir(directory):
        if not _LISTING_NAME.fullmatch(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                os.unlink(entry.name, dir_fd=directory)
        except FileNotFoundError:
            pass  # another rank removed it first


_LISTING_NAME = re.compile(r"[0-9a-f]{32}\.(lock|json|json\.[0-9]+\.tmp)")
