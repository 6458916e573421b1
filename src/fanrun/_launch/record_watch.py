"""Waiting on a run's record without a clock: woken as its files change (inotify, file_changes.py)
and as its runner ends (a pidfd): Run.wait(), and `fanrun attach` of a blocking call (rank_logs.py)."""

from __future__ import annotations

import os
import time

from .._file_changes import FileChanges
from .record_files import FINAL, process_start
from .records import STARTING_S, RunRecord


def wait(record: RunRecord, timeout: float | None = None) -> str:
    """Blocks until the run has ended, or `timeout` seconds have passed; returns its status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with FileChanges([], directories=[str(record.directory)]) as changes, ProcessEnd() as runner_end:
        while True:
            state = record.state()
            if state["status"] in FINAL or "ray_job" in state:
                return state["status"]
            runner = record.read_runner()
            if runner is not None and not runner_end.follow(runner["pid"], runner["start"]):
                continue  # it ended just now: the next read marks the run
            left = None if deadline is None else deadline - time.monotonic()
            if runner is None:  # being started: it fails once STARTING_S has passed
                starting = max(state.get("created", 0) + STARTING_S - time.time(), 0.0) + 0.1
                left = starting if left is None else min(left, starting)
            if left is not None and left <= 0:
                return state["status"]
            changes.wait(left, also=runner_end.fds)


class ProcessEnd:
    """A pidfd of the runner being waited for, readable once it has ended."""

    def __init__(self) -> None:
        self._pid = None
        self.fds: tuple[int, ...] = ()

    def follow(self, pid: int, start: int | None) -> bool:
        """Whether the process `pid` that started at `start` is still there to be waited for."""
        if pid == self._pid:
            return True
        self.close()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        if process_start(pid) != start:  # ended, or another process has its pid now
            os.close(fd)
            return False
        self._pid, self.fds = pid, (fd,)
        return True

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self._pid, self.fds = None, ()

    def __enter__(self) -> ProcessEnd:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

