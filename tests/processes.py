"""Finding processes through /proc, to prove that none outlives its run."""

from __future__ import annotations

import os
import select
import time


def processes_of_runs_under(runs_dir: str) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose environment places them in a run under runs_dir."""
    return processes_with_environment(f"FANRUN_RUN_DIR={runs_dir}".encode())


def processes_with_environment(marker: bytes) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose environment holds `marker` (inherited by all they start)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            if marker not in environ or is_zombie(pid):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append((pid, f.read().replace(b"\0", b" ").decode(errors="replace")[:200]))
        except OSError:
            continue
    return found


def tracking_agents_of(parent: int) -> list[tuple[int, str]]:
    """Live MLflow agents (_tracking/agent.py) that `parent` started: each must end with its call."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[1]) != parent:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if "fanrun._tracking.agent" in command:
            found.append((pid, command[:200]))
    return found


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone


def alive(pid: int) -> bool:
    return not is_zombie(pid)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits, on pidfds, until every pid has exited; returns those still alive after timeout."""
    deadline = time.monotonic() + timeout
    still = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            remaining = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready and alive(pid):
                still.append(pid)
        finally:
            os.close(fd)
    return still
