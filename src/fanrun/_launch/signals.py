"""Signals that must wake the engine's wait while a run lasts (Ctrl+C, a kernel interrupt)."""

from __future__ import annotations

import os
import signal
import threading


class SignalWakeup:
    """Makes a signal wake the engine's wait: while the run lasts, a pipe of ours is
    Python's signal wakeup descriptor. Whatever the previous one was (asyncio's, in a
    Jupyter kernel) gets the bytes forwarded. Only possible on the main thread, which
    is the only one Python delivers KeyboardInterrupt to anyway."""

    def __init__(self) -> None:
        self.read_fd = -1
        self._write_fd = -1
        self._previous = -1

    def __enter__(self) -> SignalWakeup:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self._previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return self
        self.read_fd, self._write_fd = read_fd, write_fd
        return self

    def drain(self) -> None:
        if self.read_fd < 0:
            return
        try:
            data = os.read(self.read_fd, 4096)
        except BlockingIOError:
            return
        if data and self._previous >= 0:
            try:
                os.write(self._previous, data)
            except OSError:
                pass

    def __exit__(self, *exc_info: object) -> None:
        if self.read_fd < 0:
            return
        signal.set_wakeup_fd(self._previous)
        os.close(self.read_fd)
        os.close(self._write_fd)
