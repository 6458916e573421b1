"""Waiting for files to be written, through Linux's inotify, never by polling: `fanrun stacks`
follows the rank logs that the dumped stacks go to; a run's record is waited for, and its rank
logs followed, as its files change (records.py, rank_logs.py)."""

from __future__ import annotations

import ctypes
import functools
import os
import select

_IN_MODIFY = 0x2
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
# In a directory: a file of it written, made, or renamed into place (a state replaced whole).
_IN_DIRECTORY_CHANGES = _IN_MODIFY | _IN_MOVED_TO | _IN_CREATE
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


@functools.cache
def _libc() -> ctypes.CDLL:
    """The process's own symbols, libc's among them, looked up once: find_library("c") runs
    ldconfig, milliseconds that a failure's evidence would wait for (rank_evidence.collectives_now)."""
    return ctypes.CDLL(None, use_errno=True)


class FileChanges:
    """Wakes when one of `paths` is written, or a file in one of `directories` is written, made
    or renamed into place; more can be watched later (watch())."""

    def __init__(self, paths: list[str], directories: list[str] = ()) -> None:
        self._libc = _libc()
        self._fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        try:
            for path in paths:
                self.watch(path)
            for directory in directories:
                self.watch(directory, directory=True)
        except BaseException:
            os.close(self._fd)
            raise

    def watch(self, path: str, directory: bool = False) -> None:
        mask = _IN_DIRECTORY_CHANGES if directory else _IN_MODIFY
        if self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask) < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot watch {path}: {os.strerror(error)}")

    def wait(self, timeout_s: float | None, also: tuple[int, ...] = ()) -> bool:
        """Until one of the files is written, one of the descriptors `also` is readable (a
        process's pidfd, once it has ended), or timeout_s (None: no limit): whether one was."""
        readable, _, _ = select.select([self._fd, *also], [], [], None if timeout_s is None else max(timeout_s, 0.0))
        if not readable:
            return False
        try:
            while os.read(self._fd, 65536):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> FileChanges:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
