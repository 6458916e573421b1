"""A run record's files, described once (records.py reads and writes them): their names, what
each holds and how it is checked, the id a record's directory is named by, and the runner's
identity (its pid and start time) and hold (a lock on runner.json).

    state.json      written as the record is made: QUEUED, its kind (blocking or detached), name,
                    world size, when it was made (created), and a Ray job's cluster
    attempt-N.json  each attempt (N from 0), once its GPUs are held: its run directory
                    (_spec/paths.py) and when it started; the run is RUNNING from the first
    end.json        FINISHED, FAILED or KILLED, when (ended), and the reason's first line
    runner.json     the process that runs the call (a blocking call's caller, a detached run's
                    runner): its pid and start time, which tell it from a later process with its
                    pid. That process holds it locked (flock) for as long as it runs the call
    outcome.pkl     a detached run's results, or the exception a blocking call would have raised
    goodput.json    the call's goodput ledger over all its attempts, as it ended (_launch/goodput.py)

A detached run's record also holds what only a detached run has (_detached/files.py).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import secrets
from pathlib import Path

from .._errors import FanrunError
from .._private_dir import open_private

QUEUED, RUNNING, FINISHED, FAILED, KILLED = "QUEUED", "RUNNING", "FINISHED", "FAILED", "KILLED"
FINAL = (FINISHED, FAILED, KILLED)
STATUSES = (QUEUED, RUNNING, *FINAL)
# A blocking call's results go to its caller; a detached run's are kept in its record.
BLOCKING, DETACHED = "blocking", "detached"

STATE = "state.json"
END = "end.json"
RUNNER = "runner.json"
OUTCOME = "outcome.pkl"
ATTEMPT = re.compile(r"attempt-(\d{1,6})\.json")

# A run's id: the function's name, the time to the second, and a part whose first five hex
# digits are the microseconds (so that the runs of one second sort as they were made) and whose
# last is random.
RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,40}-\d{8}-\d{6}-[0-9a-f]{6}")
# A record being made: its files are written before it is renamed to its id, so that no reader
# ever finds one half made.
MAKING = re.compile(r"\.making-" + RUN_ID.pattern)


class DamagedRunError(FanrunError):
    """A run's record is not as fanrun writes it; the message says what is wrong."""


def attempt_name(number: int) -> str:
    return f"attempt-{number}.json"


def made_at(name: str) -> list[str]:
    """What a run's id sorts by: its date, its time, and its microseconds."""
    return name.rsplit("-", 3)[1:]


def make_directory(parent_fd: int, name: str) -> tuple[str, str]:
    """A new record's directory, under the name it has while it is made; and the run's id."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "run"
    while True:
        now = datetime.datetime.now()
        run_id = f"{safe}-{now:%Y%m%d-%H%M%S}-{now.microsecond:05x}{secrets.randbelow(16):x}"
        making = f".making-{run_id}"
        try:
            # mkdir fails where the name exists: no two records are made under one id at once, and
            # the rename into place fails where a record of that id exists (it is not empty).
            os.mkdir(making, 0o700, dir_fd=parent_fd)
            return making, run_id
        except FileExistsError:
            continue


def hold_runner(dir_fd: int, seen: bool) -> int:
    """Writes runner.json, naming this process, locked before anyone can see it: in a record being
    made, which nobody sees yet; else (`seen`) under a name of its own, then renamed into place.
    No reader finds this process's runner.json unlocked while it runs the call. Returns the lock's
    descriptor."""
    pending = f".{RUNNER}.{os.getpid()}.{secrets.token_hex(3)}" if seen else RUNNER
    fd = open_private(dir_fd, pending, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can have this new file open: never waits
        os.write(fd, json.dumps(runner_identity()).encode())
        if seen:
            os.rename(pending, RUNNER, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return fd
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pending, dir_fd=dir_fd)
        raise


def write_new(dir_fd: int, name: str, data: bytes, sync: bool) -> None:
    """A file of a record being made, which nobody sees yet: written in place."""
    fd = open_private(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def not_a_directory(path: Path, error: OSError) -> str:
    """What is at `path` instead of a record's directory, as the error of opening it tells."""
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            return "a symbolic link, which fanrun never follows" if os.path.islink(path) else "a file"
        except OSError:
            pass
    return f"unreadable ({os.strerror(error.errno or 0)})"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 1e11


def check_state(value: dict) -> str | None:
    if value.get("status") not in STATUSES:
        return f"its status is none of {', '.join(STATUSES)}"
    if value.get("kind", DETACHED) not in (BLOCKING, DETACHED):
        return f"its kind is neither {BLOCKING} nor {DETACHED}"
    for field in ("created", "started", "ended", "updated"):
        if field in value and not _is_number(value[field]):
            return f"its {field} is not a time"
    for field in ("name", "reason", "run_dir"):
        if value.get(field) is not None and not isinstance(value[field], str):
            return f"its {field} is not text"
    size = value.get("world_size")
    if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
        return "its world_size is not a count of ranks"
    job = value.get("ray_job")
    if job is not None and not (isinstance(job, dict) and isinstance(job.get("address"), str)):
        return "its ray_job names no address"
    return None


def check_attempt(value: dict) -> str | None:
    if not isinstance(value.get("run_dir"), str):
        return "it names no run directory"
    if not _is_number(value.get("started")):
        return "its started is not a time"
    return None


def check_end(value: dict) -> str | None:
    if value.get("status") not in FINAL:
        return f"its status is none of {', '.join(FINAL)}"
    if not _is_number(value.get("ended")):
        return "its ended is not a time"
    if not isinstance(value.get("reason"), str):
        return "its reason is not text"
    return None


def check_runner(value: dict) -> str | None:
    pid, start = value.get("pid"), value.get("start")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31):
        return "its pid is not a process id"
    if start is not None and not (isinstance(start, int) and not isinstance(start, bool)):
        return "its start is not a start time"
    return None


_own_start: tuple[int, int | None] | None = None


def runner_identity() -> dict:
    """This process: its pid and start time (read once per process; a forked child reads its own)."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:
        _own_start = (pid, process_start(pid))
    return {"pid": pid, "start": _own_start[1]}


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot); None if there is none, or it has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # ended, not yet reaped
        return None
    return int(fields[19])
