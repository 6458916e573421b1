"""One run: start every rank through the engine, relay its output, wait, and turn the
outcome into the ranks' results or the root cause's exception."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from . import _core
from ._accelerators import Plan
from ._errors import RankFailedError, RemoteTraceback, ResultSerializationError, RunTimeoutError
from ._output import OutputMux
from ._paths import RunPaths, write_private
from ._rendezvous import Rendezvous
from ._worker import STACK_DUMP_SIGNAL, bootstrap_code

# From SIGTERM to SIGKILL when the run stops early.
KILL_GRACE_S = 5.0
# How long ranks get to write their stacks at a timeout before they are stopped.
STACK_DUMP_WAIT_S = 1.0
# Set in every rank unless the caller set them (Megatron-LM measured 1012 s vs 26 s
# without OMP_NUM_THREADS when ranks oversubscribe the cores).
RANK_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "PYTHONUNBUFFERED": "1",
    # A single-node run talks over loopback only.
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}


@dataclasses.dataclass
class RankProgram:
    """What every rank runs: fanrun's worker in a mode, or a native program."""

    argv: list[str]
    python: bool

    @classmethod
    def function(cls) -> RankProgram:
        return cls([sys.executable, "-u", "-c", bootstrap_code(), "function"], True)

    @classmethod
    def script(cls, path: str, args: list[str], module: bool = False) -> RankProgram:
        mode = "module" if module else "script"
        return cls([sys.executable, "-u", "-c", bootstrap_code(), mode, path, *args], True)

    @classmethod
    def native(cls, argv: list[str]) -> RankProgram:
        return cls(list(argv), False)


def run(
    *,
    name: str,
    plan: Plan,
    program: RankProgram,
    timeout: float | None,
    payload: bytes | None = None,
    extra_env: Mapping[str, str] | None = None,
    on_paths: Callable[[RunPaths], None] | None = None,
) -> list[object]:
    """Runs `program` on every rank of `plan`; returns the results in rank order
    (None for each rank of a script or native program) or raises the root cause.

    `extra_env` is set in every rank on top of the caller's environment (fanrun's own
    variables still win); `on_paths` learns the run's files before any rank starts, so
    that the caller can read the logs afterwards, whatever the outcome."""
    paths = RunPaths.create(name)
    if on_paths is not None:
        on_paths(paths)
    base_env = {**os.environ, **(extra_env or {})}
    world_size = plan.world_size
    rendezvous = None
    try:
        if payload is not None:
            write_private(paths.payload, pickle.dumps({"sys_path": list(sys.path)}), payload)
        rendezvous = Rendezvous(host_store=program.python)
        envs = [
            _flatten(rank_environment(base_env, rank, plan, rendezvous.environment(), paths))
            for rank in range(world_size)
        ]
        rendezvous.release_port_for_ranks()
        mux = OutputMux(world_size)
        with _SignalWakeup() as wakeup:
            supervisor = _core.Supervisor.start(
                argvs=[program.argv] * world_size,
                envs=envs,
                cwd=os.getcwd(),
                log_paths=[str(paths.log(r)) for r in range(world_size)],
                timeout_s=float(timeout) if timeout is not None else 0.0,
                kill_grace_s=KILL_GRACE_S,
                stack_dump_signal=int(STACK_DUMP_SIGNAL) if program.python else 0,
                stack_dump_wait_s=STACK_DUMP_WAIT_S,
                wakeup_fd=wakeup.read_fd,
                control_channel=True,
            )
            stacks: dict[int, list[str]] = {}
            try:
                _pump(supervisor, mux, wakeup, stacks)
            except BaseException:
                # Interrupted (Ctrl+C, a kernel interrupt) or broken: stop every rank
                # before the exception leaves, and keep relaying output meanwhile.
                supervisor.cancel()
                try:
                    _pump(supervisor, mux, wakeup, stacks)
                except BaseException:
                    supervisor.kill_and_reap()  # a second interrupt: no more grace
                raise
            finally:
                mux.close()
        return _outcome(name, supervisor, paths, mux, stacks, timeout, collect=payload is not None)
    finally:
        if rendezvous is not None:
            rendezvous.close()
        paths.remove_bulky_files(world_size)


def rank_environment(
    base: Mapping[str, str], rank: int, plan: Plan, rendezvous: Mapping[str, str], paths: RunPaths
) -> dict[str, str]:
    """torchrun's variables for one rank of a single-node run, on top of the caller's environment."""
    env = dict(base)
    for key, value in RANK_DEFAULTS.items():
        env.setdefault(key, value)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    world = str(plan.world_size)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=world,
        LOCAL_WORLD_SIZE=world,
        GROUP_RANK="0",
        NODE_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=world,
        TORCHELASTIC_RUN_ID=paths.run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        FANRUN_RUN_ID=paths.run_id,
        FANRUN_RUN_DIR=str(paths.directory),
        FANRUN_CONTROL_FD="3",
        FANRUN_ACCELERATOR="gpu" if plan.use_gpus else "cpu",
    )
    env.update(rendezvous)
    if not plan.use_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, even on a machine with GPUs
    return env


def _flatten(env: Mapping[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in env.items()]


def _pump(supervisor, mux: OutputMux, wakeup: _SignalWakeup, stacks: dict[int, list[str]]) -> None:
    captured: dict[int, list[str]] | None = None
    while True:
        events, interrupted, done = supervisor.wait(mux.seconds_to_redraw())
        # The stack-dump signal went out inside that wait: this batch may hold the dumps.
        if captured is None and supervisor.stop_reason == "timeout":
            captured = mux.capture_stderr()
        for kind, rank, stream, segment, data, _exit in events:
            if kind == _core.EVENT_OUTPUT:
                mux.write(rank, stream, segment, data)
        mux.flush()
        if interrupted:
            # Python's own handler runs as soon as this returns to the loop: a
            # KeyboardInterrupt is raised right here, between two waits.
            wakeup.drain()
        if done:
            if captured is not None:
                stacks.update(captured)
            return


class _SignalWakeup:
    """Makes a signal wake the engine's wait: while the run lasts, a pipe of ours is
    Python's signal wakeup descriptor. Whatever the previous one was (asyncio's, in a
    Jupyter kernel) gets the bytes forwarded. Only possible on the main thread, which
    is the only one Python delivers KeyboardInterrupt to anyway."""

    def __init__(self) -> None:
        self.read_fd = -1
        self._write_fd = -1
        self._previous = -1

    def __enter__(self) -> _SignalWakeup:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self._previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return self
        self.read_fd, self._write_fd = read_fd, write_fd
        return self

    def drain(self) -> None:
        if self.read_fd < 0:
            return
        try:
            data = os.read(self.read_fd, 4096)
        except BlockingIOError:
            return
        if data and self._previous >= 0:
            try:
                os.write(self._previous, data)
            except OSError:
                pass

    def __exit__(self, *exc_info: object) -> None:
        if self.read_fd < 0:
            return
        signal.set_wakeup_fd(self._previous)
        os.close(self.read_fd)
        os.close(self._write_fd)


def _outcome(name, supervisor, paths, mux, stacks, timeout, collect: bool) -> list[object]:
    world_size = supervisor.world_size
    reason = supervisor.stop_reason
    if reason == "timeout":
        running = list(supervisor.ranks_running_at_timeout)
        raise RunTimeoutError(_timeout_message(name, timeout, running, stacks, paths), running_ranks=running, stacks=stacks)
    if reason == "rank_failed":
        error = _root_cause(supervisor.first_failed_rank, supervisor, paths, mux)
        raise error from error.__cause__
    if not collect:
        return [None] * world_size
    results = []
    for rank in range(world_size):
        try:
            with open(paths.result(rank), "rb") as file:
                results.append(pickle.load(file))
        except FileNotFoundError:
            raise RankFailedError(
                f"Rank {rank} of {world_size} (pid {supervisor.pid(rank)}) exited with code 0 but returned "
                f"no result: did the function call os._exit()?{_tail_text(mux, rank)}\nFull log: {paths.log(rank)}",
                rank=rank,
                pid=supervisor.pid(rank),
                exit_code=0,
                log_path=str(paths.log(rank)),
                log_tail=list(mux.stderr_tails[rank]),
            ) from None
    return results


def _root_cause(rank: int, supervisor, paths: RunPaths, mux: OutputMux) -> BaseException:
    world_size = supervisor.world_size
    pid = supervisor.pid(rank)
    log = str(paths.log(rank))
    who = f"Rank {rank} of {world_size} (pid {pid})"
    tail = list(mux.stderr_tails[rank])
    common = dict(rank=rank, pid=pid, log_path=log, log_tail=tail)
    envelope = _load_envelope(paths.error(rank))
    if envelope is not None:
        remote = RemoteTraceback(f"\n\nTraceback from rank {rank} (pid {pid}):\n{_format_remote(envelope)}")
        if envelope["kind"] == "result":
            error: BaseException = ResultSerializationError(
                f"Rank {rank} returned a value of type {envelope['result_type']} that cannot be pickled to "
                f"send back ({envelope['type']}: {envelope['message']}). Return plain data (numbers, "
                f"lists, dicts, tensors, arrays), or save large objects to a file and return its path.",
                rank=rank,
                type_name=envelope["result_type"],
            )
            error.__cause__ = remote
            return error
        if envelope["kind"] == "exit":
            code = envelope["exit_code"]
            return RankFailedError(f"{who} called sys.exit({code!r}).{_tail_text(mux, rank)}\nFull log: {log}", exit_code=code, **common)
        exception = _unpickle(envelope["exception"])
        if exception is None:
            error = RankFailedError(
                f"{who} raised {envelope['type']}: {envelope['message']} "
                f"(the exception could not be re-created here, so it is reported as this error)\nFull log: {log}",
                exit_code=1,
                **common,
            )
            error.__cause__ = remote
            return error
        _label(exception, rank, world_size, pid, log)
        exception.__cause__ = remote
        return exception
    code, signo = supervisor.exit_status(rank)
    if signo:
        name = _signal_name(signo)
        message = f"{who} was killed by {name}"
        if signo == signal.SIGKILL:
            message += "; the kernel's out-of-memory killer is a likely cause (see `dmesg`)"
        elif signo in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL):
            message += ", a crash in native code; its Python stack, if it had one, is in its stderr"
        return RankFailedError(message + f".{_tail_text(mux, rank)}\nFull log: {log}", signal_name=name, **common)
    return RankFailedError(f"{who} exited with code {code}.{_tail_text(mux, rank)}\nFull log: {log}", exit_code=code, **common)


def _format_remote(envelope: dict) -> str:
    """The rank's traceback with source lines looked up here, where a notebook's cells are known."""
    frames = envelope.get("frames")
    if not frames:
        return envelope["traceback"]
    summary = traceback.StackSummary.from_list([(f, n, name, None) for f, n, name in frames])
    return "Traceback (most recent call last):\n" + "".join(summary.format()) + envelope["exception_only"]


def _label(exception: BaseException, rank: int, world_size: int, pid: int, log: str) -> None:
    """Names the rank in the message where the message is a plain string, and in a note always."""
    args = exception.args
    if type(exception).__str__ is BaseException.__str__ and len(args) == 1 and isinstance(args[0], str):
        exception.args = (f"[rank {rank}] {args[0]}",)
    exception.add_note(f"fanrun: raised on rank {rank} of {world_size} (pid {pid}); full log: {log}")


def _load_envelope(path: Path) -> dict | None:
    try:
        with open(path, "rb") as file:
            return pickle.load(file)
    except FileNotFoundError:
        return None


def _unpickle(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        value = pickle.loads(data)
    except Exception:
        return None
    return value if isinstance(value, BaseException) else None


def _signal_name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


def _tail_text(mux: OutputMux, rank: int, lines: int = 20) -> str:
    tail = list(mux.stderr_tails[rank])[-lines:]
    if not tail:
        return " It wrote nothing to stderr."
    return "\nLast lines of its stderr:\n" + "\n".join("    " + line for line in tail)


def _timeout_message(name, timeout, running, stacks, paths, lines_per_rank: int = 40) -> str:
    parts = [
        f"{name!r} timed out after {timeout:g} s; ranks still running: {', '.join(map(str, running)) or 'none'}. "
        f"Every rank's Python stack was dumped before the kill:"
    ]
    for rank in sorted(stacks):
        parts.append(f"--- rank {rank} ---")
        parts.extend(stacks[rank][:lines_per_rank])
    parts.append(f"Logs: {paths.directory}")
    return "\n".join(parts)
