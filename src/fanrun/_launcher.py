"""One run: start every rank through the engine, relay its output, wait, and turn the
outcome into the ranks' results or the root cause's exception."""

from __future__ import annotations

import dataclasses
import os
import pickle
import resource
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from . import _core, _hints, _result_file, _run_contract
from ._accelerators import Plan
from ._errors import (
    DescriptorLimitError,
    RankFailedError,
    RemoteTraceback,
    ResultSerializationError,
    RunTimeoutError,
    WorkingDirectoryError,
)
from ._output import OutputMux
from ._paths import RunPaths
from ._rendezvous import Rendezvous
from ._worker import STACK_DUMP_SIGNAL, bootstrap_code

# From SIGTERM to SIGKILL when the run stops early.
KILL_GRACE_S = 5.0
# How long ranks get to write their stacks at a timeout before they are stopped.
STACK_DUMP_WAIT_S = 1.0
# Each rank runs under a keeper of its own, which ends every process the rank started when the
# rank ends or the caller dies (cpp/include/fanrun/kept_process.h).
KEEPER = str(Path(__file__).with_name("fanrun-keeper"))
# Descriptors the caller holds for each rank while a run lasts: its log, stdout, stderr and
# control pipes, its keeper's pidfd and socket, and the rendezvous store's connections from it.
DESCRIPTORS_PER_RANK = 8
# Those the engine holds for a moment while it starts a rank, some of them numbered 64 and up.
DESCRIPTORS_TO_START = 16
FIRST_HIGH_DESCRIPTOR = 64
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


# Whether this process has said that it found no GPU: once is enough, a notebook that calls
# again knows it by then.
no_gpu_notice_shown = False


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
    preflight(plan)
    global no_gpu_notice_shown
    if plan.notice and not no_gpu_notice_shown:
        no_gpu_notice_shown = True
        print(f"fanrun: {plan.notice}", file=sys.stderr, flush=True)
    paths = RunPaths.create(name)
    base_env = {**os.environ, **(extra_env or {})}
    world_size = plan.world_size
    rendezvous = None
    try:
        if on_paths is not None:
            on_paths(paths)
        if payload is not None:
            paths.write_payload(pickle.dumps({"sys_path": list(sys.path)}), payload)
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
                # A function's rank that ends without its result or its error has failed.
                expect_done=payload is not None,
                keeper=KEEPER,
            )
            timeout_report = _TimeoutReport(python=program.python)
            try:
                _pump(supervisor, mux, wakeup, timeout_report)
            except BaseException:
                # Interrupted (Ctrl+C, a kernel interrupt) or broken: stop every rank
                # before the exception leaves, and keep relaying output meanwhile.
                supervisor.cancel()
                try:
                    _pump(supervisor, mux, wakeup, timeout_report)
                except BaseException:
                    supervisor.kill_and_reap()  # a second interrupt: no more grace
                raise
            finally:
                mux.close()
        return _outcome(name, supervisor, paths, mux, timeout_report, timeout, collect=payload is not None)
    except Exception as error:
        if not plan.use_gpus:
            _hints.note_gpu_call_on_cpu(error, plan.description)
        raise
    finally:
        if rendezvous is not None:
            rendezvous.close()
        try:
            paths.remove_bulky_files(world_size)
        finally:
            paths.close()


def preflight(plan: Plan) -> None:
    """What would stop a run halfway, found before anything starts: a working directory that
    was deleted (the ranks start in it, and importing torch there crashes), and a descriptor
    limit too low for this many ranks."""
    try:
        os.getcwd()
    except FileNotFoundError:
        try:
            where = os.readlink("/proc/self/cwd")
        except OSError:
            where = "unknown"
        raise WorkingDirectoryError(
            f"the working directory no longer exists ({where}): it was removed after this process entered it, "
            f"and every rank starts in it. Change to an existing directory (os.chdir or cd) and try again"
        ) from None
    _check_descriptor_limit(plan.world_size)


def _check_descriptor_limit(world_size: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    open_now = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself held
    needed = max(open_now + DESCRIPTORS_PER_RANK * world_size + DESCRIPTORS_TO_START,
                 FIRST_HIGH_DESCRIPTOR + DESCRIPTORS_TO_START)
    if needed <= soft:
        return
    suggested = max(4096, 2 * needed)
    if hard != resource.RLIM_INFINITY:
        suggested = min(suggested, hard)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if needed <= hard:
        advice = (
            f"Raise it before starting Python (`ulimit -n {suggested}` in the shell), or in Python with "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({suggested}, hard))"
        )
    else:
        advice = "That is above the hard limit: run fewer ranks, or have the hard limit raised (limits.conf)"
    raise DescriptorLimitError(
        f"a run of {world_size} rank{'s' if world_size != 1 else ''} needs about {needed} file descriptors in this "
        f"process ({open_now} are open already), but its limit of open files (RLIMIT_NOFILE) is {soft}, "
        f"hard limit {hard_text}. {advice}; `ulimit -n` shows the limit."
    )


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
    )
    env[_run_contract.ENV_RUN_ID] = paths.run_id
    env[_run_contract.ENV_RUN_DIR] = str(paths.directory)
    env[_run_contract.ENV_CONTROL_FD] = str(_run_contract.CONTROL_FD)
    env[_run_contract.ENV_ACCELERATOR] = "gpu" if plan.use_gpus else "cpu"
    env.update(rendezvous)
    if not plan.use_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, even on a machine with GPUs
    return env


def _flatten(env: Mapping[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in env.items()]


def _pump(supervisor, mux: OutputMux, wakeup: _SignalWakeup, timeout_report: _TimeoutReport) -> None:
    while True:
        events, interrupted, done = supervisor.wait(mux.seconds_to_redraw())
        for kind, rank, stream, segment, data, _exit in events:
            if kind == _core.EventKind.OUTPUT:
                mux.write(rank, stream, segment, data)
            elif kind == _core.EventKind.TIMED_OUT:
                # The stack-dump signal is out and the ranks still run: from here, stderr is
                # kept, and what stands in the way of a dump can still be seen.
                timeout_report.start(supervisor, mux)
        mux.flush()
        if interrupted:
            # Python's own handler runs as soon as this returns to the loop: a
            # KeyboardInterrupt is raised right here, between two waits.
            wakeup.drain()
        if done:
            return


class _TimeoutReport:
    """What the ranks still running at a timeout left: each one's dumped stack, or why none came."""

    def __init__(self, python: bool) -> None:
        self._python = python
        self._captured: dict[int, list[str]] = {}
        self._obstacles: dict[int, str] = {}

    def start(self, supervisor, mux: OutputMux) -> None:
        self._captured = mux.capture_stderr()
        if self._python:
            for rank in supervisor.ranks_running_at_timeout:
                obstacle = _dump_obstacle(supervisor.pid(rank), STACK_DUMP_SIGNAL)
                if obstacle is not None:
                    self._obstacles[rank] = obstacle

    def split(self, running: list[int]) -> tuple[dict[int, list[str]], dict[int, str]]:
        """(the stacks dumped, by rank; why each other running rank has none)."""
        stacks, missing = {}, {}
        for rank in running:
            lines = self._captured.get(rank, [])
            if any(_STACK_HEADER in line for line in lines):
                stacks[rank] = lines
            elif not self._python:
                missing[rank] = "a native program has no Python stack to dump"
            else:
                missing[rank] = self._obstacles.get(
                    rank, f"it wrote no stack within {STACK_DUMP_WAIT_S:g} s of {STACK_DUMP_SIGNAL.name}"
                )
        return stacks, missing


# What faulthandler writes above every thread's stack.
_STACK_HEADER = "(most recent call first)"


def _dump_obstacle(pid: int, signo: signal.Signals) -> str | None:
    """Why `pid` cannot answer `signo` with a stack, as far as /proc tells; None if nothing seen."""
    bit = 1 << (signo - 1)
    try:
        status = _proc_status(f"/proc/{pid}/status")
        threads = [_proc_status(f"/proc/{pid}/task/{tid}/status") for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    state = status.get("State", "")
    if state[:1] in ("T", "t"):
        return f"it is stopped ({state}: SIGSTOP or a debugger)"
    if int(status.get("SigIgn", "0"), 16) & bit:
        return f"it ignores {signo.name}"
    if threads and all(int(thread.get("SigBlk", "0"), 16) & bit for thread in threads):
        return f"it blocks {signo.name} in every thread"
    if not int(status.get("SigCgt", "0"), 16) & bit:
        return f"it has no handler for {signo.name} (faulthandler's was removed)"
    return None


def _proc_status(path: str) -> dict[str, str]:
    with open(path) as file:
        return dict(line.rstrip("\n").split(":\t", 1) for line in file if ":\t" in line)


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


def _outcome(name, supervisor, paths, mux, timeout_report: _TimeoutReport, timeout, collect: bool) -> list[object]:
    world_size = supervisor.world_size
    reason = supervisor.stop_reason
    if reason == _core.StopReason.TIMEOUT:
        running = list(supervisor.ranks_running_at_timeout)
        stacks, missing = timeout_report.split(running)
        raise RunTimeoutError(
            _timeout_message(name, timeout, running, stacks, missing, paths),
            running_ranks=running,
            stacks=stacks,
            missing_stacks=missing,
        )
    if reason == _core.StopReason.RANK_FAILED:
        error = _root_cause(supervisor.first_failed_rank, supervisor, paths, mux)
        raise error from error.__cause__
    if not collect:
        return [None] * world_size
    results = []
    for rank in range(world_size):
        try:
            with paths.open_result(rank) as file:
                results.append(_result_file.read(file, paths.result(rank)))
        except FileNotFoundError:
            raise RankFailedError(
                f"Rank {rank} of {world_size} (pid {supervisor.pid(rank)}) returned, but its result file "
                f"{paths.result(rank)} is gone: was the run directory removed during the call?\nFull log: {paths.log(rank)}",
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
    if code == 0:
        # Only a function's rank fails with code 0: it ended without writing its result or error.
        return RankFailedError(
            f"{who} exited with code 0 without returning a result: the function neither returned nor raised "
            f"(os._exit(0), or a library that ended the process).{_tail_text(mux, rank)}\nFull log: {log}",
            exit_code=0,
            **common,
        )
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


def _timeout_message(name, timeout, running, stacks, missing, paths, lines_per_rank: int = 40) -> str:
    parts = [f"{name!r} timed out after {timeout:g} s; ranks still running: {', '.join(map(str, running)) or 'none'}."]
    if stacks:
        parts.append(f"Python stacks dumped before the kill: {_ranks(sorted(stacks))}.")
    reasons: dict[str, list[int]] = {}
    for rank, why in sorted(missing.items()):
        reasons.setdefault(why, []).append(rank)
    for why, ranks in reasons.items():
        parts.append(f"No stack from {_ranks(ranks)}: {why}.")
    for rank in sorted(stacks):
        parts.append(f"--- rank {rank} ---")
        parts.extend(stacks[rank][:lines_per_rank])
    parts.append(f"Logs: {paths.directory}")
    return "\n".join(parts)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
