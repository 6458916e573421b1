"""Waiting for files to be written, through Linux's inotify: `fanrun stacks` follows the rank
logs that the dumped stacks go to without polling them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select

_IN_MODIFY = 0x2
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


class FileChanges:
    def __init__(self, paths: list[str]) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        for path in paths:
            if libc.inotify_add_watch(self._fd, os.fsencode(path), _IN_MODIFY) < 0:
                error = ctypes.get_errno()
                os.close(self._fd)
                raise OSError(error, f"cannot watch {path}")

    def wait(self, timeout_s: float) -> bool:
        """Until one of the files is written, or timeout_s: whether one was."""
        readable, _, _ = select.select([self._fd], [], [], max(timeout_s, 0.0))
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
