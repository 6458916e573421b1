"""Detached runs on disk. Each run has a directory of its own under <runs root>/detached, private
to its user (0700, like the runs root above it, so nobody else can list, attach to or cancel it):

    spec.pkl      what to run: the call's payload, its options, the caller's sys.path and directory
    state.json    QUEUED, RUNNING, FINISHED, FAILED or KILLED, and when; replaced atomically
    runner.json   the runner process: pid and start time, which tell it from a later process with its pid
    output.log    everything the call printed, as a blocking call prints it in the cell
    outcome.pkl   the results, or the exception a blocking call would have raised
    attach.sock   while the runner lives: where attach() reads the output live (stream.py)
    reserved      while the runner lives: room held on the disk for the final state, released
                  just before it is written, so that a full disk never loses a run's end

A run whose files cannot be read as fanrun writes them (not JSON, not its fields, a link, a file
where a directory should be) is damaged: reading it raises DamagedRunError, which names what is
wrong, and the other runs are read as ever.

A run of a Ray job (ray_job.py) has state.json alone, naming the cluster, until it has ended.

A run whose state is not final but whose runner is gone is marked FAILED, with the reason, by
whoever reads its state first: a crash at any point never leaves a run that claims to run.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path

from .._errors import FanrunError, UnknownRunError
from .._spec.paths import open_runs_root
from .._private_dir import open_private, open_private_subdir, replace_private

QUEUED, RUNNING, FINISHED, FAILED, KILLED = "QUEUED", "RUNNING", "FINISHED", "FAILED", "KILLED"
FINAL = (FINISHED, FAILED, KILLED)

SPEC = "spec.pkl"
STATE = "state.json"
RUNNER = "runner.json"
OUTPUT = "output.log"
OUTCOME = "outcome.pkl"
SOCKET = "attach.sock"
RESERVED = "reserved"
STATUSES = (QUEUED, RUNNING, *FINAL)
# What the runner holds for its last writes: state.json and, on a full disk, a failure's outcome.
RESERVED_BYTES = 128 * 1024
# The errors of a disk (or a quota) that has no room left.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

# A run's id: the function's name, the time to the second, and a random part.
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,40}-\d{8}-\d{6}-[0-9a-f]{6}")
# A run that has no runner on record yet is still being started, for this long at most.
STARTING_S = 60.0
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REMEDY = "Remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a directory of your own."


class DamagedRunError(FanrunError):
    """A run's directory or files are not as fanrun writes them; the message says what is wrong."""


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
    os.close(parent_fd)
    try:
        _check_directory(parent / run_id)
    except UnknownRunError:
        raise UnknownRunError(f"no run {run_id} in {parent} (`fanrun list --all` shows your runs)") from None
    return parent / run_id


def _not_a_directory(path: Path, error: OSError) -> str:
    """What is at `path` instead of a run's directory, as the error of opening it tells."""
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            return "a symbolic link, which fanrun never follows" if os.path.islink(path) else "a file"
        except OSError:
            pass
    return f"unreadable ({os.strerror(error.errno or 0)})"


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
    state = {**(_read_checked(directory, STATE, _check_state) or {}), **changes, "updated": time.time()}
    write_json(directory, STATE, state)
    return state


def state(directory: Path) -> dict:
    """The run's state; a run whose runner has ended without a final state is marked FAILED
    (on disk where it can be written: a reader on a full disk still gets it). DamagedRunError
    where state.json or runner.json is not as fanrun writes it."""
    _check_directory(directory)
    current = read_state(directory) or {"status": FAILED, "reason": "its state file is missing"}
    if current["status"] in FINAL or "ray_job" in current:  # a Ray job's is the cluster's to tell (ray_job.py)
        return current
    runner = read_runner(directory)
    if runner is None:
        if time.time() - current.get("created", 0) < STARTING_S:
            return current  # being started
        reason = "its runner never started"
    elif process_start(runner["pid"]) == runner["start"]:
        return current
    else:
        reason = f"its runner (pid {runner['pid']}) ended without recording an outcome"
    # The runner may have written its final state just before it ended.
    current = read_state(directory) or current
    if current["status"] in FINAL:
        return current
    marked = {**current, "status": FAILED, "reason": reason, "ended": time.time()}
    try:
        return update_state(directory, status=FAILED, reason=reason, ended=marked["ended"])
    except OSError:
        return marked  # a full or read-only disk: the next reader marks it


def _check_directory(directory: Path) -> None:
    """DamagedRunError where a run's name is a file or a link; UnknownRunError where it is gone."""
    try:
        os.close(os.open(directory, _DIRECTORY_FLAGS))
    except FileNotFoundError:
        raise UnknownRunError(f"run {directory.name} is gone from {directory.parent}") from None
    except OSError as error:
        raise DamagedRunError(f"{directory} is {_not_a_directory(directory, error)}, not a run's directory; "
                              f"remove it if it is not yours to keep") from None


def read_state(directory: Path) -> dict | None:
    """state.json, checked (DamagedRunError where it is not as fanrun writes it); None if missing."""
    return _read_checked(directory, STATE, _check_state)


def read_runner(directory: Path) -> dict | None:
    """runner.json, checked as state.json is."""
    return _read_checked(directory, RUNNER, _check_runner)


def _read_checked(directory: Path, name: str, check) -> dict | None:
    try:
        data = read_bytes(directory, name)
    except (FanrunError, OSError) as error:  # a link, a directory, another user's file
        raise DamagedRunError(f"its {name} cannot be read: {error}") from None
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise DamagedRunError(f"its {name} is not JSON ({len(data)} bytes)") from None
    why = check(value) if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"
    if why is not None:
        raise DamagedRunError(f"its {name} is damaged: {why}")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 1e11


def _check_state(value: dict) -> str | None:
    if value.get("status") not in STATUSES:
        return f"its status is none of {', '.join(STATUSES)}"
    for field in ("created", "started", "ended", "updated"):
        if field in value and not _is_number(value[field]):
            return f"its {field} is not a time"
    for field in ("name", "reason", "run_dir"):
        if value.get(field) is not None and not isinstance(value[field], str):
            return f"its {field} is not text"
    job = value.get("ray_job")
    if job is not None and not (isinstance(job, dict) and isinstance(job.get("address"), str)):
        return "its ray_job names no address"
    return None


def _check_runner(value: dict) -> str | None:
    pid, start = value.get("pid"), value.get("start")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31):
        return "its pid is not a process id"
    if start is not None and not (isinstance(start, int) and not isinstance(start, bool)):
        return "its start is not a start time"
    return None


def reserve_room(directory: Path) -> None:
    """Holds RESERVED_BYTES of the run's disk for its last writes; OSError where it has not that much."""
    dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    try:
        fd = open_private(dir_fd, RESERVED, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    finally:
        os.close(dir_fd)
    try:
        try:
            os.posix_fallocate(fd, 0, RESERVED_BYTES)  # blocks on the disk, not a hole that takes nothing
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.write(fd, bytes(RESERVED_BYTES))  # a file system that allocates no room ahead: zeros hold it
    finally:
        os.close(fd)


def release_room(directory: Path) -> None:
    """Gives back the room reserve_room() held, just before the writes it was held for."""
    dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    try:
        os.unlink(RESERVED, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)


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
