"""The calls of this process whose ranks run now, and each run's ranks.json: which processes
on which host are its ranks, so that `fanrun stacks` (stacks.py) can find them from another
thread or another process and know a reused pid from the rank."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from .._spec.paths import RunPaths
from ..backends.stack_dump import start_time

RANKS_FILE = "ranks.json"

_lock = threading.Lock()
_running: dict[str, Path] = {}  # run id -> run directory


def add(paths: RunPaths, ranks, local: bool) -> None:
    """Records a call's ranks: its pids where they run on this machine (local)."""
    if local:
        pids = [ranks.pid(rank) for rank in range(ranks.world_size)]
        record = {"host": socket.gethostname(), "ranks": [[pid, start_time(pid)] for pid in pids]}
        paths.write_file(RANKS_FILE, json.dumps(record).encode())
    with _lock:
        _running[paths.run_id] = paths.directory


def remove(paths: RunPaths) -> None:
    """The call's ranks have ended: its record goes, so that no one looks for them."""
    with _lock:
        _running.pop(paths.run_id, None)
    paths.remove_file(RANKS_FILE)


def running() -> dict[str, Path]:
    with _lock:
        return dict(_running)
