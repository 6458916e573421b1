"""Asking a rank on this machine for its stack: every backend asks on the machine where the rank
runs. A rank is signalled through a pidfd and known by its start time, so that a pid reused by
another process is never signalled; why one cannot dump its stack is read from /proc while it
still runs; what it dumped is read back from its file, never through a link, as it grows."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

# What faulthandler writes above every thread's stack.
STACK_HEADER = "(most recent call first)"


def start_time(pid: int) -> int | None:
    """The process's start, in clock ticks since boot: a pid reused later has another."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])  # field 22 of stat(5); the two before the ")" split are gone


def send_signal(pid: int, started: int | None, signo: int) -> str | None:
    """Sends `signo` to the rank that started at `started`; why not, where it cannot be."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return "it has ended"
    try:
        # Checked once the pidfd holds the process: a pid reused since is another start time.
        if start_time(pid) != started:
            return "it has ended"
        signal.pidfd_send_signal(pidfd, signo)
    except ProcessLookupError:
        return "it has ended"
    finally:
        os.close(pidfd)
    return None


class DumpReader:
    """What signalled ranks dump into their files (a stacks file, a log), read as it grows: each
    file is read from where it ended when the reader was made, and a dump counts as done once it
    holds a stack header and no file has grown for a while (faulthandler writes no end mark)."""

    def __init__(self, paths: Mapping[int, Path]) -> None:
        self._paths = dict(paths)
        self._ends = {rank: file_size(path) for rank, path in self._paths.items()}
        self._dumped: dict[int, bytes] = {}
        self._last_growth = time.monotonic()

    def watch(self, ranks: Iterable[int]) -> None:
        """Reads, from now on, the dumps of `ranks`, which were just signalled."""
        self._dumped.update((rank, b"") for rank in ranks)
        self._last_growth = time.monotonic()

    def read(self) -> None:
        for rank in self._dumped:
            more = read_from(self._paths[rank], self._ends[rank])
            if more:
                self._ends[rank] += len(more)
                self._dumped[rank] += more
                self._last_growth = time.monotonic()

    def texts(self) -> dict[int, str]:
        return {rank: dumped.decode("utf-8", "replace") for rank, dumped in self._dumped.items()}

    def holds_stacks(self, ranks: Iterable[int]) -> bool:
        """Whether the dump of each of `ranks` that is watched holds a stack header."""
        header = STACK_HEADER.encode()
        return all(header in self._dumped[rank] for rank in ranks if rank in self._dumped)

    def quiet_s(self) -> float:
        """Seconds since any watched file last grew."""
        return time.monotonic() - self._last_growth


def file_size(path: Path) -> int:
    """The file's size; 0 where it does not exist yet."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def read_from(path: Path, offset: int) -> bytes:
    """What the file holds past `offset`, never through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link in place of a log is not read
    except FileNotFoundError:
        return b""
    with os.fdopen(fd, "rb") as file:
        file.seek(offset)
        return file.read()


def obstacle(pid: int, signo: signal.Signals) -> str | None:
    """Why `pid` cannot answer `signo` with a stack, as far as /proc tells; None if nothing seen."""
    bit = 1 << (signo - 1)
    try:
        status = _proc_status(f"/proc/{pid}/status")
        threads = [_proc_status(f"/proc/{pid}/task/{tid}/status") for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    state = status.get("State", "")
    if state[:1] in ("T", "t"):
        return f"it is stopped ({state}: SIGSTOP or a debugger)"
    if int(status.get("SigIgn", "0"), 16) & bit:
        return f"it ignores {signo.name}"
    if threads and all(int(thread.get("SigBlk", "0"), 16) & bit for thread in threads):
        return f"it blocks {signo.name} in every thread"
    if not int(status.get("SigCgt", "0"), 16) & bit:
        return f"it has no handler for {signo.name} (faulthandler's was removed)"
    return None


def _proc_status(path: str) -> dict[str, str]:
    with open(path) as file:
        return dict(line.rstrip("\n").split(":\t", 1) for line in file if ":\t" in line)
