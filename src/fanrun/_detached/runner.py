"""The runner of one detached run: `python -c <run.start's bootstrap> <run id>`.

run.start() starts it in a session of its own, so the run goes on when the process that started
it ends, even by SIGKILL. It is the call's caller from then on: it runs the call through the one
call path with the run's record (_launch/records.py), as a blocking `.distributed()` would (the
engine's supervisor, the ranks' keepers, tracking), with its output going to the run's Broadcast
(stream.py), and records the end and the outcome. SIGTERM (Run.cancel) stops the ranks as Ctrl+C
stops a blocking call's.

A full disk never loses the run's end: the runner holds room for its last writes from the start
(reserve_room), its output stops where the disk is full while the run goes on, and the run ends
FAILED with the reason "disk full: ..." in the room it held.
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import sys
import traceback

from .._launch import call
from .._launch.record_files import FAILED, FINISHED, KILLED, OUTCOME
from .._launch.records import NO_ROOM, RunRecord
from .._errors import FanrunError, RemoteTraceback, raised_for_the_caller
from . import files, stream

# What the runner holds for its last writes: state.json and, on a full disk, a failure's outcome.
RESERVED_BYTES = 128 * 1024


class Cancelled(BaseException):
    """SIGTERM: the run is cancelled; raised where the runner is, as KeyboardInterrupt is."""


def main() -> None:
    record = RunRecord.find(sys.argv[1])
    record.own()  # held until this process ends: the record is this runner's
    reserve_room(record)  # a disk too full for it fails the start, which the caller reports
    spec = pickle.loads(record.read_bytes(files.SPEC))
    sys.path[:] = spec["sys_path"]
    os.chdir(spec["cwd"])
    signal.signal(signal.SIGTERM, cancel)
    broadcast = stream.Broadcast(record.directory)
    # The caller returns once the socket is up: from then on, attach() finds the run.
    os.write(1, b"ready\n")
    _descriptors_to(record)
    sys.stdout, sys.stderr = broadcast.stdout, broadcast.stderr
    try:
        status, outcome, reason = _run(spec, record)
        if broadcast.log_error is not None:
            status, outcome, reason = _lost_output(broadcast.log_error, status, reason)
        _record_end(record, status, outcome, reason)
    finally:
        broadcast.close()


def _lost_output(log_error: str, status: str, reason: str) -> tuple[str, bytes, str]:
    """A run whose output could not all be kept fails, whatever the call did: it is said why."""
    reason = f"{log_error}; the call itself ended {status}{f' ({reason})' if reason else ''}"
    return FAILED, failure(FanrunError(f"the run's output was not kept: {reason}")), reason


def _record_end(record: RunRecord, status: str, outcome: bytes, reason: str) -> None:
    """outcome.pkl, then the final state, in the room held for them since the start."""
    release_room(record)
    try:
        record.write_bytes(OUTCOME, outcome)
    except OSError as error:
        if error.errno not in NO_ROOM:
            raise
        reason = f"disk full: its outcome ({len(outcome)} bytes) could not be written; the call itself ended {status}"
        status = FAILED
        record.write_bytes(OUTCOME, failure(FanrunError(f"the run's outcome was not kept: {reason}")))
    record.end(status, reason)


def reserve_room(record: RunRecord) -> None:
    """Holds RESERVED_BYTES of the run's disk for its last writes; OSError where it has not that much."""
    fd = record.open_file(files.RESERVED, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        try:
            os.posix_fallocate(fd, 0, RESERVED_BYTES)  # blocks on the disk, not a hole that takes nothing
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.write(fd, bytes(RESERVED_BYTES))  # a file system that allocates no room ahead: zeros hold it
    finally:
        os.close(fd)


def release_room(record: RunRecord) -> None:
    """Gives back the room reserve_room() held, just before the writes it was held for."""
    dir_fd = os.open(record.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.unlink(files.RESERVED, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)


def cancel(signo, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough: the ranks are being stopped
    raise Cancelled()


def _descriptors_to(record: RunRecord) -> None:
    """What is written to descriptors 1 and 2 below Python (the engine's own warnings) goes to
    runner.log, so that output.log holds the call's output alone."""
    fd = record.open_file(files.RUNNER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _run(spec: dict, record: RunRecord) -> tuple[str, bytes, str]:
    """(status, outcome.pkl's bytes, reason)."""
    import cloudpickle

    try:
        # QUEUED until its GPUs are free; on a full disk, the run goes on, and its end is written
        # in the room held for it.
        results = call.run(spec["call"], record=record)
    except Cancelled:
        print("fanrun: the run was cancelled; its ranks were stopped", file=sys.stderr)
        return KILLED, cloudpickle.dumps({"cancelled": True}), "cancelled"
    except BaseException as error:  # noqa: B036 - whatever a blocking call would raise, recorded
        # As a blocking call shows it in the cell.
        traceback.print_exception(type(error), error, None if raised_for_the_caller(error) else error.__traceback__)
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return FAILED, failure(error), f"disk full: {error}"
        return FAILED, failure(error), f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return FINISHED, cloudpickle.dumps({"results": results}), ""


def failure(error: BaseException) -> bytes:
    import cloudpickle

    cause = error.__cause__
    recorded = {
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "text": "".join(traceback.format_exception(type(error), error, None)),
        "cause": str(cause) if isinstance(cause, RemoteTraceback) else None,
    }
    try:
        data = cloudpickle.dumps(error)
        pickle.loads(data)  # one that cannot be rebuilt is carried as its text
        recorded["exception"] = data
    except Exception:
        recorded["exception"] = None
    return cloudpickle.dumps(recorded)

