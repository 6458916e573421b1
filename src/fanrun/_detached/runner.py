"""The runner of one detached run: `python -c <run.start's bootstrap> <run directory>`.

run.start() starts it in a session of its own, so the run goes on when the process that started
it ends, even by SIGKILL. It is the call's caller from then on: it runs the call as a blocking
`.distributed()` would (the engine's supervisor, the ranks' keepers, tracking), with its output
going to the run's Broadcast (stream.py), and records the state and the outcome (store.py).
SIGTERM (Run.cancel) stops the ranks as Ctrl+C stops a blocking call's.

A full disk never loses the run's end: the runner holds room for its last writes from the start
(store.reserve_room), its output stops where the disk is full while the run goes on, and the run
ends FAILED with the reason "disk full: ..." in the room it held.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path

from .._launch import call
from .._errors import FanrunError, RemoteTraceback, raised_for_the_caller
from . import store, stream


class Cancelled(BaseException):
    """SIGTERM: the run is cancelled; raised where the runner is, as KeyboardInterrupt is."""


def main() -> None:
    directory = Path(sys.argv[1])
    store.write_json(directory, store.RUNNER, store.runner_identity())
    store.reserve_room(directory)  # a disk too full for it fails the start, which the caller reports
    spec = pickle.loads(store.read_bytes(directory, store.SPEC))
    sys.path[:] = spec["sys_path"]
    os.chdir(spec["cwd"])
    signal.signal(signal.SIGTERM, cancel)
    broadcast = stream.Broadcast(directory)
    # The caller returns once the socket is up: from then on, attach() finds the run.
    os.write(1, b"ready\n")
    _descriptors_to(directory)
    sys.stdout, sys.stderr = broadcast.stdout, broadcast.stderr
    try:
        status, outcome, reason = _run(spec, directory)
        if broadcast.log_error is not None:
            status, outcome, reason = _lost_output(broadcast.log_error, status, reason)
        _record_end(directory, status, outcome, reason)
    finally:
        broadcast.close()


def _lost_output(log_error: str, status: str, reason: str) -> tuple[str, bytes, str]:
    """A run whose output could not all be kept fails, whatever the call did: it is said why."""
    reason = f"{log_error}; the call itself ended {status}{f' ({reason})' if reason else ''}"
    return store.FAILED, failure(FanrunError(f"the run's output was not kept: {reason}")), reason


def _record_end(directory: Path, status: str, outcome: bytes, reason: str) -> None:
    """outcome.pkl, then the final state, in the room held for them since the start."""
    store.release_room(directory)
    try:
        store.write_bytes(directory, store.OUTCOME, outcome)
    except OSError as error:
        if error.errno not in store.NO_ROOM:
            raise
        reason = f"disk full: its outcome ({len(outcome)} bytes) could not be written; the call itself ended {status}"
        status = store.FAILED
        store.write_bytes(directory, store.OUTCOME, failure(FanrunError(f"the run's outcome was not kept: {reason}")))
    store.update_state(directory, status=status, ended=time.time(), reason=reason)


def cancel(signo, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough: the ranks are being stopped
    raise Cancelled()


def _descriptors_to(directory: Path) -> None:
    """What is written to descriptors 1 and 2 below Python (the engine's own warnings) goes to
    runner.log, so that output.log holds the call's output alone."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = store.open_private(dir_fd, "runner.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    finally:
        os.close(dir_fd)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _run(spec: dict, directory: Path) -> tuple[str, bytes, str]:
    """(status, outcome.pkl's bytes, reason)."""
    import cloudpickle

    call_spec = spec["call"]
    try:
        def record(paths) -> None:
            # Each attempt, once its GPUs are free: QUEUED until then.
            try:
                store.update_state(directory, status=store.RUNNING, started=time.time(), run_dir=str(paths.directory),
                                   world_size=call_spec.plan.world_size)
            except OSError as error:
                # A full disk: the run goes on, and its end is written in the room held for it.
                if error.errno not in store.NO_ROOM:
                    raise

        results = call.run(call_spec, on_paths=record)
    except Cancelled:
        print("fanrun: the run was cancelled; its ranks were stopped", file=sys.stderr)
        return store.KILLED, cloudpickle.dumps({"cancelled": True}), "cancelled"
    except BaseException as error:  # noqa: B036 - whatever a blocking call would raise, recorded
        # As a blocking call shows it in the cell.
        traceback.print_exception(type(error), error, None if raised_for_the_caller(error) else error.__traceback__)
        if isinstance(error, OSError) and error.errno in store.NO_ROOM:
            return store.FAILED, failure(error), f"disk full: {error}"
        return store.FAILED, failure(error), f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return store.FINISHED, cloudpickle.dumps({"results": results}), ""


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

