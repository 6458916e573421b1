"""Local directories and fsspec URLs behind one small interface, and the checks built on it:
is a path a complete checkpoint, does its metadata match its record, which checkpoint under a
root is the newest, pruning, and removal of what crashed or failed saves left behind."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import tempfile
import threading
import uuid

from ... import _core
from ..._errors import CheckpointCorruptError, NotACheckpointError
from . import layout


class Replaced(Exception):
    """A checkpoint was replaced while it was being read; reading the path again gives the new one."""


# Each retry follows a replacement seen to happen: a path overwritten in a tight loop could
# otherwise keep a reader going round.
_REPLACED_RETRIES = 5


def is_fsspec_url(path: str) -> bool:
    """A checkpoint path that fsspec writes and reads: any URL, file:// included (staged and
    uploaded like any object store), where a plain path is written in place by the engine."""
    return "://" in path


def target_path(path: str) -> str:
    """How a checkpoint's path is kept: a URL without a trailing slash, a local path absolute."""
    return path.rstrip("/") if is_fsspec_url(path) else os.path.abspath(path)


class LocalStorage:
    """A local or mounted filesystem."""

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def list_names(self, directory: str) -> list[str]:
        try:
            return os.listdir(directory)
        except FileNotFoundError:
            return []

    def record_and_sizes(self, directory: str) -> tuple[bytes, dict[str, int]]:
        """The record's bytes and the directory's file sizes, both read through one descriptor
        of the directory. Raises Replaced when a new checkpoint was swapped in at its name
        meanwhile: the old one, which this may have read, is being removed."""
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                with open(layout.RECORD_NAME, "rb", opener=lambda name, flags: os.open(name, flags, dir_fd=fd)) as f:
                    text: bytes | None = f.read()
                sizes = {}
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.is_file(follow_symlinks=False):
                            sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                text = None
            opened = os.fstat(fd)
        finally:
            os.close(fd)
        now = os.stat(directory)
        if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
            raise Replaced(directory)
        if text is None:
            raise FileNotFoundError(os.path.join(directory, layout.RECORD_NAME))
        return text, sizes

    def remove_checkpoint(self, path: str) -> None:
        # Renamed out of sight first, so that a crash half-way leaves a hidden leftover (removed
        # by the next save) rather than a visible, half-deleted checkpoint.
        aside = layout.removing_dir(path, uuid.uuid4().hex)
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)


class RemoteStorage:
    """An fsspec filesystem; paths are URLs."""

    def __init__(self, url: str) -> None:
        import fsspec

        self._fs, _ = fsspec.core.url_to_fs(url)

    def join(self, directory: str, name: str) -> str:
        return directory.rstrip("/") + "/" + name

    def read_bytes(self, path: str) -> bytes:
        with self._fs.open(path, "rb") as f:
            return f.read()

    def list_names(self, directory: str) -> list[str]:
        try:
            entries = self._fs.ls(directory, detail=False)
        except FileNotFoundError:
            return []
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def file_sizes(self, directory: str) -> dict[str, int | None]:
        """Sizes by name; None where the listing gives none (an HTTP server's index page)."""
        try:
            entries = self._fs.ls(directory, detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: None if e.get("size") is None else int(e["size"])
            for e in entries
            if e.get("type") == "file"
        }

    def get_file(self, directory: str, name: str, local_path: str) -> None:
        """Downloads one file of the checkpoint at directory. One that is not there is a
        NotACheckpointError naming its URL; other failures keep their type, with the URL added."""
        url = self.join(directory, name)
        try:
            self._fs.get_file(url, local_path)
        except FileNotFoundError:
            raise NotACheckpointError(
                f"Checkpoint file '{url}' is not there (not found): '{directory}' no longer holds the "
                "complete checkpoint that was opened. It may have been replaced or removed; open it again"
            ) from None
        except Exception as error:
            error.add_note(f"Fetching checkpoint file '{url}' failed")
            raise

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self._fs.cat_file(path, start=start, end=start + length) if length else b""

    def put_file(self, local_path: str, directory: str, name: str) -> None:
        """Uploads a local file as directory/name, making directory where the store has folders."""
        self._fs.makedirs(directory, exist_ok=True)
        self._fs.put_file(local_path, self.join(directory, name))

    def write_bytes(self, directory: str, name: str, data: bytes) -> None:
        """One object written whole: where a store makes an object visible only once it is
        closed, this is what commits a checkpoint (its record)."""
        with self._fs.open(self.join(directory, name), "wb") as f:
            f.write(data)

    def remove(self, directory: str, name: str) -> None:
        self._fs.rm(self.join(directory, name), recursive=True)

    def record_and_sizes(self, directory: str) -> tuple[bytes, dict[str, int | None]]:
        # Data and metadata names carry the save id, and a replaced checkpoint's files are
        # removed only after the new record is written: a record read here names files that
        # were there when it was written.
        text = self.read_bytes(self.join(directory, layout.RECORD_NAME))
        return text, self.file_sizes(directory)

    def remove_checkpoint(self, path: str) -> None:
        # The record goes first: without it the rest is no longer a complete checkpoint.
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self.join(path, layout.RECORD_NAME))
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(path, recursive=True)


def storage_for(path: str) -> LocalStorage | RemoteStorage:
    return RemoteStorage(path) if is_fsspec_url(path) else LocalStorage()


def read_record(path: str) -> dict:
    """The record of the complete checkpoint at path, or NotACheckpointError saying why not."""
    storage = storage_for(path)
    for _ in range(_REPLACED_RETRIES):
        try:
            return _read_record_once(storage, path)
        except Replaced:
            continue
    raise NotACheckpointError(f"'{path}' was replaced {_REPLACED_RETRIES} times while it was being read")


def _read_record_once(storage: LocalStorage | RemoteStorage, path: str) -> dict:
    record_path = storage.join(path, layout.RECORD_NAME)
    try:
        text, sizes = storage.record_and_sizes(path)
    except (FileNotFoundError, NotADirectoryError):
        raise NotACheckpointError(
            f"'{path}' is not a fanrun checkpoint: it has no {layout.RECORD_NAME}. Pass a directory "
            "written by VolumeWriter; latest_checkpoint(root) finds the newest complete one"
        ) from None
    try:
        record = layout.parse_record(text, f"'{record_path}'")
    except ValueError as error:
        raise NotACheckpointError(f"'{path}' is not a readable fanrun checkpoint: {error}") from None
    wanted = {**record["files"], record["metadata"]: None}
    for name, size in wanted.items():
        if name not in sizes:
            raise NotACheckpointError(f"'{path}' is incomplete: its file '{name}' is missing")
        found = sizes[name]
        if size is not None and found is not None and found < size:
            raise NotACheckpointError(
                f"'{path}' is incomplete: its file '{name}' has {found} bytes, {size} were written"
            )
    found = sizes[record["metadata"]]
    if "metadata_size" in record and found is not None and found != record["metadata_size"]:
        raise NotACheckpointError(
            f"'{path}' is damaged: its metadata '{record['metadata']}' has {found} bytes, "
            f"{record['metadata_size']} were written"
        )
    return record


def read_metadata_bytes(path: str, record: dict, local_staging_dir: str | None = None) -> bytes:
    """The bytes of the metadata that record names, checked by the engine against the size and
    CRC32C the record gives before anything unpickles them (a record of version 1 gives neither:
    its metadata is read as it is). Remote metadata is downloaded to local_staging_dir first.
    A mismatch is a CheckpointCorruptError naming the file."""
    name = record["metadata"]
    if not is_fsspec_url(path):
        return _read_checked(os.path.join(path, name), record)
    remote = RemoteStorage(path)
    local_dir = tempfile.mkdtemp(prefix="fanrun-download-", dir=local_staging_dir)
    local = os.path.join(local_dir, name)
    try:
        remote.get_file(path, name, local)
        return _read_checked(local, record)
    except CheckpointCorruptError as error:
        # Named by its URL: the downloaded copy is gone once this returns.
        raise CheckpointCorruptError(str(error).replace(local, remote.join(path, name))) from None
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def _read_checked(local_path: str, record: dict) -> bytes:
    if "metadata_crc32c" not in record:
        with open(local_path, "rb") as f:
            return f.read()
    size = record["metadata_size"]
    # Compared before a buffer of the recorded size is allocated: the record may be damaged too.
    found = os.path.getsize(local_path)
    if found != size:
        raise CheckpointCorruptError(
            f"Checkpoint metadata '{local_path}' has {found} bytes where its record says {size} were "
            "written: it was damaged after it was written. Load an older checkpoint"
        )
    data = bytearray(size)
    address = ctypes.addressof((ctypes.c_char * size).from_buffer(data)) if size else 0
    _core.read_checkpoint_items(
        [local_path], [(0, 0, size, address, size, record["metadata_crc32c"], "metadata")], 1,
        _core.CHECKPOINT_CHUNK_BYTES,
    )
    return bytes(data)


def _metadata_verifies(path: str) -> bool:
    """Whether path holds a complete checkpoint whose metadata matches its record."""
    for _ in range(_REPLACED_RETRIES):
        try:
            record = read_record(path)
        except OSError:  # NotACheckpointError
            return False
        try:
            read_metadata_bytes(path, record)
            return True
        except OSError:  # CheckpointCorruptError, a missing file
            pass
        # A checkpoint replaced meanwhile took its metadata with it: check the new one.
        try:
            if read_record(path)["save_id"] == record["save_id"]:
                return False
        except OSError:
            return False
    return False


def complete_checkpoints(root: str) -> list[tuple[int, str, str]]:
    """(published_ns, name, path) of every complete checkpoint directly under root, oldest first."""
    storage = storage_for(root)
    found = []
    for name in storage.list_names(root):
        if name.startswith("."):
            continue
        path = storage.join(root, name)
        try:
            record = read_record(path)
        except (NotACheckpointError, OSError):
            continue
        found.append((record["published_ns"], name, path))
    found.sort()
    return found


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under root (by time of publication), or None.

    Saves in progress, crashed saves, checkpoints whose metadata does not match their record and
    directories that are not fanrun checkpoints are ignored, so the result is always safe to load."""
    root = os.fspath(root)
    for _, _, path in reversed(complete_checkpoints(root)):
        if _metadata_verifies(path):
            return path
    return None


def prune(root: str, keep_last: int, published: str) -> None:
    """Removes all but the keep_last newest complete checkpoints under root; never `published`."""
    storage = storage_for(root)
    found = complete_checkpoints(root)
    for _, _, path in found[: max(0, len(found) - keep_last)]:
        if path != published:
            storage.remove_checkpoint(path)


@contextlib.contextmanager
def _locked_if_free(lock_path: str):
    """Yields True with the lock held when no live process holds it (or it does not exist)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def clean_leftovers(parent: str) -> list[str]:
    """Removes what crashed or failed saves left in parent: partial directories whose saving
    process is gone (its lock is free) or whose save in this process is over, replaced or pruned
    checkpoints whose removal was interrupted. Returns what it removed."""
    removed = []
    for name in LocalStorage().list_names(parent):
        path = os.path.join(parent, name)
        if layout.REMOVING_MARK in name and layout.is_leftover_name(name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif layout.is_leftover_name(name) and not name.endswith(layout.LOCK_SUFFIX):
            _release_if_over(path + layout.LOCK_SUFFIX)
            with _locked_if_free(path + layout.LOCK_SUFFIX) as free:
                if free:
                    shutil.rmtree(path, ignore_errors=True)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path + layout.LOCK_SUFFIX)
                    removed.append(path)
        elif layout.is_leftover_name(name) and not os.path.exists(path[: -len(layout.LOCK_SUFFIX)]):
            with _locked_if_free(path) as free:
                if free:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
    return removed


def _release_if_over(lock_path: str) -> None:
    """Releases a save lock of this process whose save is over. flock cannot tell: this process
    holds it as firmly as a save still writing would. A save that failed on another rank never
    hears of it, and its writer keeps the lock until it is collected (an exception that is still
    referenced holds it). But one thread runs one save at a time, so a lock taken by the thread
    that is starting a new save, or by a thread that has ended, belongs to a save that is over."""
    with _HELD_LOCK:
        held = _HELD.get(lock_path)
    if held is not None and (held.thread is threading.current_thread() or not held.thread.is_alive()):
        held.release()


class SaveLock:
    """Held by the coordinator while a save is in progress: its partial directory is not a
    leftover as long as this lock is held (the kernel drops it when the process dies)."""

    def __init__(self, partial: str) -> None:
        self.path = partial + layout.LOCK_SUFFIX
        self.thread = threading.current_thread()
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        with _HELD_LOCK:
            _HELD[self.path] = self

    def release(self) -> None:
        with _HELD_LOCK:
            if self._fd is None:
                return
            if _HELD.get(self.path) is self:
                del _HELD[self.path]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None


# The save locks this process holds, by path (see _release_if_over). Reentrant: a writer's
# finalizer releases its lock wherever the garbage collector runs, which may be inside another
# release in the same thread.
_HELD: dict[str, SaveLock] = {}
_HELD_LOCK = threading.RLock()
