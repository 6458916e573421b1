"""The caller's tracking agent (agent.py): one per process, started at the first tracked
call and kept for the life of the process, serving every call of every thread.

Importing mlflow and opening a store cost seconds of CPU; paid once per process, a later call
finds them done and its run is made in milliseconds. A call hands the agent its description and
its ranks' metric socket, and later its outcome, and then waits until the agent says it has
closed the run ("closed"): its status, parameters and the ranks' last metrics are then in the
store. A close that overran that wait is waited for by wait_closed(): fanrun.flush_tracking()
and the caller's exit.

The agent dies with the caller: it watches the caller's pid (a pidfd, so a forked child that
inherited the channel does not keep it alive) and its end of the channel, and then closes what
is still open (a call still running as KILLED) within a bound, and exits.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Protocol

from .agent_channel import describe, receive, send
from .links import TrackedRun

# Lines of the agent's own output shown when it fails, from at most its last bytes.
LOG_TAIL_LINES = 15
LOG_TAIL_BYTES = 1 << 16


class CallListener(Protocol):
    """What a call gives the connection: where its answers go, where its warnings point, and its
    run once the agent has made it."""

    warning_at: tuple
    run: TrackedRun | None

    def answered(self, kind: str, body: dict) -> None: ...


class AgentConnection:
    """The running agent and its channel. Messages from the agent are read by one thread and
    handed to their call; the closes still awaited are counted here."""

    def __init__(self) -> None:
        self._control, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Unlinked at once: nothing to remove, however the caller ends; read back only on failure.
        self._log = tempfile.TemporaryFile()
        self._env = dict(os.environ)  # what the agent's environment is, as the calls change it
        try:
            with agent_end:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", _agent_code(), str(agent_end.fileno()), str(os.getpid())],
                    pass_fds=(agent_end.fileno(),), env=self._env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
                    # Out of the terminal's process group: Ctrl+C stops the call, and the agent
                    # then closes the run as KILLED.
                    start_new_session=True,
                )
        except BaseException:
            self._control.close()
            self._log.close()
            raise
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._state = threading.Condition()
        self._calls: dict[int, CallListener] = {}  # calls the agent has not yet said closed
        self._closing: set[int] = set()  # of those, the ended ones: their close is under way
        self._unanswered: set[int] = set()
        self.alive = True
        self._reader = threading.Thread(target=self._read, name="fanrun-mlflow-agent", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def usable(self) -> bool:
        return self.alive and self.process.poll() is None

    def open_call(self, call: dict, listener_fd: int, listener: CallListener) -> int:
        """Sends the call with its metric socket; returns its id. Raises OSError if the agent is gone."""
        with self._send_lock:
            call_id = next(self._ids)
            with self._state:
                self._calls[call_id] = listener
                self._unanswered.add(call_id)
            # The agent's environment follows the caller's, call by call (MLflow reads its
            # configuration from it): only what changed since the last call travels.
            current = dict(os.environ)
            changes = {
                "set": {k: v for k, v in current.items() if self._env.get(k) != v},
                "unset": [k for k in self._env if k not in current],
            }
            try:
                send(self._control, {"call": {**call, "id": call_id, "env": changes, "cwd": os.getcwd()}}, (listener_fd,))
            except OSError:
                with self._state:
                    self._calls.pop(call_id, None)
                    self._unanswered.discard(call_id)
                raise
            self._env = current
        return call_id

    def call_directory(self, call_id: int, run_dir: str, world_size: int) -> None:
        """Tells the agent the attempt's directory, where its samples read the ranks' progress."""
        with self._state:
            if call_id not in self._calls:
                return  # the agent is gone
        try:
            with self._send_lock:
                send(self._control, {"directory": {"id": call_id, "run_dir": run_dir, "world_size": world_size}})
        except OSError:
            pass  # the agent is gone: the reader says so for this call

    def finish_call(self, call_id: int, outcome: dict) -> None:
        """Hands the agent the call's outcome; wait_call_closed() waits for the run's close."""
        with self._state:
            if call_id not in self._calls:
                return  # the agent has already ended it (it is gone)
            self._closing.add(call_id)
        try:
            with self._send_lock:
                send(self._control, {"finish": {**outcome, "id": call_id}})
        except OSError:
            pass  # the agent is gone: the reader says so for this call too

    def wait_call_closed(self, call_id: int, timeout: float | None) -> bool:
        """Waits until the agent has closed this call's run (or is gone, which _lost() reports);
        False if it has not after `timeout` seconds."""
        with self._state:
            return self._state.wait_for(lambda: call_id not in self._calls, timeout)

    def wait_closed(self, timeout: float | None) -> int:
        """Waits until the agent has closed the run of every call that has ended; returns how many it
        has not closed after `timeout` seconds."""
        with self._state:
            self._state.wait_for(lambda: not self._closing, timeout)
            return len(self._closing)

    def close(self, wait_s: float) -> None:
        """Ends the channel: the agent finishes what it still has within its own bound and exits,
        waited for here at most `wait_s` seconds."""
        with self._state:
            self.alive = False
        # shutdown, not only close: the reader thread's recv holds the socket, and the agent
        # would see no end until it returned.
        try:
            self._control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._control.close()
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass  # it ends alone, within its bound
        self._log.close()

    def log_tail(self) -> str:
        try:
            fd = self._log.fileno()
            size = os.fstat(fd).st_size
            text = os.pread(fd, LOG_TAIL_BYTES, max(0, size - LOG_TAIL_BYTES)).decode(errors="replace")
        except (OSError, ValueError):  # ValueError: closed
            return ""
        lines = text.strip().splitlines()[-LOG_TAIL_LINES:]
        return (":\n" + "\n".join("    " + line for line in lines)) if lines else ""

    def _read(self) -> None:
        try:
            while True:
                message, fds = receive(self._control)
                for fd in fds:  # the agent sends none
                    os.close(fd)
                if message is None:
                    break
                self._dispatch(*next(iter(message.items())))
        except (OSError, ValueError) as error:
            self._lost(f" ({describe(error)})")
            return
        self._lost("")

    def _dispatch(self, kind: str, body: dict) -> None:
        call_id = body["id"]
        with self._state:
            listener = self._calls.get(call_id)
            if kind == "closed":
                self._calls.pop(call_id, None)
                self._closing.discard(call_id)
                if listener is not None:
                    for message in body["warnings"]:
                        add_warning(message, listener.warning_at)
                self._state.notify_all()
                return
            self._unanswered.discard(call_id)
        if listener is not None:
            listener.answered(kind, body)

    def _lost(self, cause: str) -> None:
        """The agent is gone: every call still waiting for an answer is told tracking is off, and
        the run of every other call it had not closed may stay open."""
        if not self.alive:
            return  # closed by close(): what it still has, it finishes alone
        try:
            self.process.wait(5)  # its exit status, for the message
        except subprocess.TimeoutExpired:
            pass
        code = self.process.poll()
        ended = f"the process that tracks it ended{'' if code is None else f' with {code}'}{cause}{self.log_tail()}"
        with self._state:
            self.alive = False
            lost, unanswered = list(self._calls.items()), set(self._unanswered)
            self._calls.clear()
            self._closing.clear()
            self._unanswered.clear()
            self._state.notify_all()
        for call_id, listener in lost:
            if call_id in unanswered:
                listener.answered("off", {"problem": ended})
            elif listener.run is not None:
                run = listener.run
                add_warning(f"fanrun: the MLflow run {run.run_name} ({run.run_id}) may not be closed: {ended}; "
                                 f"the call's outcome is unchanged.", listener.warning_at)

    def forget_in_child(self) -> None:
        """In a forked child: its copy of the channel is closed, so that only the caller holds the
        agent's end open (the child's reader thread did not survive the fork)."""
        self._control.close()
        self._log.close()


def _agent_code() -> str:
    """The agent's -c program: with the caller's sys.path, as a rank has it, so that it imports the
    same fanrun and mlflow as the caller."""
    return f"import sys; sys.path[:] = {sys.path!r}; from fanrun._tracking.agent import main; main()"


# ---------------------------------------------------------------- the process's one agent

_lock = threading.Lock()
_connection: AgentConnection | None = None
_warnings_lock = threading.Lock()
_warnings: list[tuple[str, tuple]] = []  # (message, the user's line it points to), to be shown


def add_warning(message: str, where: tuple) -> None:
    """A warning about a call that has ended, shown at the next call, flush_tracking() or exit."""
    with _warnings_lock:
        _warnings.append((message, where))


def take_warnings() -> list[tuple[str, tuple]]:
    global _warnings
    with _warnings_lock:
        taken, _warnings = _warnings, []
    return taken


def give_back_warnings(untold: list[tuple[str, tuple]]) -> None:
    """Warnings taken but not shown (one before them was raised as an error): shown next time."""
    with _warnings_lock:
        _warnings[:0] = untold


def connection() -> AgentConnection:
    """The process's agent, started now if there is none (or the last one died). Raises OSError."""
    global _connection
    with _lock:
        if _connection is None or not _connection.usable():
            if _connection is not None:
                _connection.close(0)
            _connection = AgentConnection()
        return _connection


def current() -> AgentConnection | None:
    """The process's agent if one was started (it may have died since)."""
    return _connection


def agent_pid() -> int | None:
    """The pid of this process's agent while it runs: a process that lives as long as its caller."""
    running = _connection
    return running.pid if running is not None and running.usable() else None


def shutdown(wait_s: float) -> AgentConnection | None:
    """Closes the channel of this process's agent and waits at most `wait_s` for it to exit;
    the next tracked call starts a new one. Returns the connection that was ended."""
    global _connection
    with _lock:
        ended, _connection = _connection, None
    if ended is not None:
        ended.close(wait_s)
    return ended


def _forget_in_child() -> None:
    global _connection, _lock, _warnings_lock, _warnings
    # Another thread may have held them at the fork; the parent's warnings are the parent's.
    _lock, _warnings_lock, _warnings = threading.Lock(), threading.Lock(), []
    if _connection is not None:
        _connection.forget_in_child()
        _connection = None


os.register_at_fork(after_in_child=_forget_in_child)
