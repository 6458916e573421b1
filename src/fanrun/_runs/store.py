"""Detached runs on disk. Each run has a directory of its own under <runs root>/detached, private
to its user (0700, like the runs root above it, so nobody else can list, attach to or cancel it):

    spec.pkl      what to run: the call's payload, its options, the caller's sys.path and directory
    state.json    QUEUED, RUNNING, FINISHED, FAILED or KILLED, and when; replaced atomically
    runner.json   the runner process: pid and start time, which tell it from a later process with its pid
    output.log    everything the call printed, as a blocking call prints it in the cell
    outcome.pkl   the results, or the exception a blocking call would have raised
    attach.sock   while the runner lives: where attach() reads the output live (stream.py)

A run of a Ray job (ray_job.py) has state.json alone, naming the cluster, until it has ended.

A run whose state is not final but whose runner is gone is marked FAILED, with the reason, by
whoever reads its state first: a crash at any point never leaves a run that claims to run.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path

from .._errors import UnknownRunError
from .._launch.paths import open_runs_root
from .._private_dir import open_private, open_private_subdir, replace_private

QUEUED, RUNNING, FINISHED, FAILED, KILLED = "QUEUED", "RUNNING", "FINISHED", "FAILED", "KILLED"
FINAL = (FINISHED, FAILED, KILLED)

SPEC = "spec.pkl"
STATE = "state.json"
RUNNER = "runner.json"
OUTPUT = "output.log"
OUTCOME = "outcome.pkl"
SOCKET = "attach.sock"

# A run's id: the function's name, the time to the second, and a random part.
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,40}-\d{8}-\d{6}-[0-9a-f]{6}")
# A run that has no runner on record yet is still being started, for this long at most.
STARTING_S = 60.0
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REMEDY = "Remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a directory of your own."


def root() -> tuple[Path, int]:
    """The directory of detached runs and a descriptor of it, made private where missing."""
    runs_root, runs_fd = open_runs_root()
    try:
        fd = open_private_subdir(runs_fd, "detached", str(runs_root), what="fanrun's detached runs directory",
                                 remedy=_REMEDY)
    finally:
        os.close(runs_fd)
    return runs_root / "detached", fd


def create(name: str) -> Path:
    """A new run's directory, made 0700 (mkdir fails where the name exists: no run reuses one)."""
    parent, parent_fd = root()
    try:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "run"
        run_id = f"{safe}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        os.mkdir(run_id, 0o700, dir_fd=parent_fd)
        return parent / run_id
    finally:
        os.close(parent_fd)


def claim_key(key: str, run_id: str) -> str:
    """The run of idempotency key `key`: `run_id` if this call is the first to claim the key,
    else the run that claimed it first (a link is made or fails as one step)."""
    parent, parent_fd = root()
    try:
        keys_fd = open_private_subdir(parent_fd, "keys", str(parent), what="fanrun's idempotency keys", remedy=_REMEDY)
    finally:
        os.close(parent_fd)
    try:
        name = hashlib.sha256(key.encode()).hexdigest()
        temporary = f".{name}.{os.getpid()}.{secrets.token_hex(3)}"
        fd = open_private(keys_fd, temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, run_id.encode())
        finally:
            os.close(fd)
        try:
            os.link(temporary, name, src_dir_fd=keys_fd, dst_dir_fd=keys_fd)
            return run_id
        except FileExistsError:
            fd = open_private(keys_fd, name, os.O_RDONLY)
            try:
                return os.read(fd, 256).decode()
            finally:
                os.close(fd)
        finally:
            os.unlink(temporary, dir_fd=keys_fd)
    finally:
        os.close(keys_fd)


def remove_unstarted(directory: Path) -> None:
    """A run's directory made for a submission that another with its idempotency key preceded."""
    for name in os.listdir(directory):
        os.unlink(directory / name)
    os.rmdir(directory)


def find(run_id: str) -> Path:
    """The directory of the run `run_id`; UnknownRunError where this user has none of that id."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise UnknownRunError(f"{run_id!r} is not a run id (a run id looks like train-20261201-140512-a3f9c1; "
                              f"`fanrun list --all` shows yours)")
    parent, parent_fd = root()
    try:
        fd = os.open(run_id, _DIRECTORY_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        raise UnknownRunError(f"no run {run_id} in {parent} (`fanrun list --all` shows your runs)") from None
    finally:
        os.close(parent_fd)
    os.close(fd)
    return parent / run_id


def all_runs() -> list[Path]:
    """Every run's directory, oldest first."""
    parent, parent_fd = root()
    try:
        names = [name for name in os.listdir(parent_fd) if _RUN_ID.fullmatch(name)]
    finally:
        os.close(parent_fd)
    return [parent / name for name in sorted(names, key=lambda name: name.rsplit("-", 3)[1:3])]


def write_json(directory: Path, name: str, value: dict) -> None:
    """Replaces `name` atomically: a reader sees the old file or the new one, never a part."""
    write_bytes(directory, name, json.dumps(value).encode())


def write_bytes(directory: Path, name: str, data: bytes) -> None:
    dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    try:
        replace_private(dir_fd, name, data)
    finally:
        os.close(dir_fd)


def read_bytes(directory: Path, name: str) -> bytes | None:
    dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    try:
        fd = open_private(dir_fd, name, os.O_RDONLY)
    except FileNotFoundError:
        return None
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as file:
        return file.read()


def read_json(directory: Path, name: str) -> dict | None:
    data = read_bytes(directory, name)
    return None if data is None else json.loads(data)


def update_state(directory: Path, **changes: object) -> dict:
    """Written by the runner alone once it runs (and before, by the caller that starts it)."""
    state = {**(read_json(directory, STATE) or {}), **changes, "updated": time.time()}
    write_json(directory, STATE, state)
    return state


def state(directory: Path) -> dict:
    """The run's state; a run whose runner has ended without a final state is marked FAILED."""
    current = read_json(directory, STATE) or {"status": FAILED, "reason": "its state file is missing"}
    if current["status"] in FINAL or "ray_job" in current:  # a Ray job's is the cluster's to tell (ray_job.py)
        return current
    runner = read_json(directory, RUNNER)
    if runner is None:
        if time.time() - current.get("created", 0) < STARTING_S:
            return current  # being started
        reason = "its runner never started"
    elif process_start(runner["pid"]) == runner["start"]:
        return current
    else:
        reason = f"its runner (pid {runner['pid']}) ended without recording an outcome"
    # The runner may have written its final state just before it ended.
    current = read_json(directory, STATE) or current
    if current["status"] in FINAL:
        return current
    return update_state(directory, status=FAILED, reason=reason, ended=time.time())


def runner_identity() -> dict:
    return {"pid": os.getpid(), "start": process_start(os.getpid())}


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
