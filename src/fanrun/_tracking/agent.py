"""The process that does a caller's MLflow work: one per caller process, started with its first
tracked call (agent_connection.py) and serving every call after it.

Importing mlflow and opening a store cost about two seconds of CPU, most of it Python. In a
thread of the caller that time would be taken turn about with the caller's own Python work,
since both need the GIL; in a process of its own it runs beside the caller and the ranks, on
another core, and leaves the caller's process as it was: no mlflow imported there, no MLflow log
lines or tqdm warnings in a notebook's cell. Kept for the caller's life, it is paid once: a later
call's run is made in milliseconds, and closed in a fraction of a second.

Each call is a CallRun (agent_run.py) in a thread of its own. The main thread only reads the
caller's messages (agent_channel.py), and watches the caller: when its channel closes or the
caller's process ends (a pidfd: a forked child that inherited the channel does not count), every
call without an outcome is closed as KILLED, every close under way is given until
EXIT_DEADLINE_S, and the agent exits. Its stderr goes to a file the caller reads only if it fails.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
import time

from .agent_channel import FINISH_DEADLINE_S, receive, send
from .agent_run import CALLER_ENDED, CallRun

# Once the caller is gone, how long the agent may still take to close what it has.
EXIT_DEADLINE_S = FINISH_DEADLINE_S


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    caller = int(sys.argv[2])
    try:
        caller_ended: int | None = os.pidfd_open(caller)
    except ProcessLookupError:
        os._exit(0)
    except OSError:  # a kernel older than 5.3: the channel's end alone says the caller is gone
        caller_ended = None
    if os.getppid() != caller:  # the caller died before it could be watched: its pid may be another's
        os._exit(0)
    # Imported while the caller's first call is described and sent (or, in Jupyter, before any
    # call): the first run is then made as soon as it can be.
    threading.Thread(target=_import_mlflow, name="fanrun-import-mlflow", daemon=True).start()
    _Agent(control).serve(caller_ended)
    # The teardown of an interpreter that imported mlflow takes a few tenths of a second, and
    # nothing is left to do: the work is done and sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _import_mlflow() -> None:
    try:
        import mlflow  # noqa: F401
        from mlflow import MlflowClient  # noqa: F401
    except Exception:
        pass  # the first call's own import says why


class _Agent:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.calls: dict[int, CallRun] = {}
        self._send_lock = threading.Lock()

    def serve(self, caller_ended: int | None) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.control, selectors.EVENT_READ)
        if caller_ended is not None:
            selector.register(caller_ended, selectors.EVENT_READ)
        while True:
            ready = {key.fileobj for key, _ in selector.select()}
            if caller_ended is not None and caller_ended in ready:
                break
            try:
                message, fds = receive(self.control)
            except (OSError, ValueError):
                break
            if message is None:
                break
            self.handle(message, fds)
        self.caller_gone()

    def handle(self, message: dict, fds: list[int]) -> None:
        kind, body = next(iter(message.items()))
        self.calls = {call_id: run for call_id, run in self.calls.items() if run.thread.is_alive()}
        if kind == "call" and len(fds) == 1:
            _follow_caller(body.pop("env"), body.pop("cwd"), body["argv0"])
            run = CallRun(body, socket.socket(fileno=fds[0]), self.reply, self.calls.get(body["parent_call"]))
            self.calls[run.id] = run
            run.start()
            return
        for fd in fds:  # none expected with any other message
            os.close(fd)
        run = self.calls.get(body["id"])
        if run is None:
            return
        if kind == "directory":
            run.directory(body)
        elif kind == "finish":
            run.end(body)

    def reply(self, message: dict) -> None:
        """From any call's thread; the caller may be gone, and then nobody needs the answer."""
        with self._send_lock:
            try:
                send(self.control, message)
            except OSError:
                pass

    def caller_gone(self) -> None:
        deadline = time.monotonic() + EXIT_DEADLINE_S
        for run in self.calls.values():
            run.end(CALLER_ENDED)
        for run in self.calls.values():
            run.thread.join(max(0.0, deadline - time.monotonic()))


def _follow_caller(env: dict, cwd: str, argv0: str) -> None:
    """The caller's environment, working directory and program as of this call: where MLflow looks
    for its configuration, resolves a relative store and finds the run's source. (Shared by every
    call in the agent: calls of one process that run at once see the latest call's.)"""
    for name in env["unset"]:
        os.environ.pop(name, None)
    os.environ.update(env["set"])
    try:
        os.chdir(cwd)
    except OSError:
        pass  # a folder removed since: MLflow's relative defaults resolve where the agent is
    sys.argv = [argv0]


if __name__ == "__main__":
    main()
