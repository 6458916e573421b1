"""How a run ended, for the caller: the ranks' results, or the root cause's exception (the
rank's own, with its traceback chained, or one that says how it exited), or a timeout's."""

from __future__ import annotations

import pickle
import signal
import traceback
from pathlib import Path

from .. import _core
from .._errors import RankFailedError, RemoteTraceback, ResultSerializationError, RunTimeoutError
from .._rank import result_file
from .._rank.contract import ENVELOPE_KEYS, ENVELOPE_KINDS, STACK_DUMP_SIGNAL
from ..backends.base import STACK_DUMP_WAIT_S
from ..backends.stack_dump import STACK_HEADER
from .._display.output import OutputMux
from .._spec.paths import RunPaths
from . import failure_peers


def collect(name, ranks, paths, mux, timeout_report: TimeoutReport, timeout, returns_values: bool) -> list[object]:
    """The ranks' results in rank order, or the exception that says how the run ended."""
    world_size = ranks.world_size
    if ranks.failure is not None:
        raise ranks.failure  # the backend's own: a node lost
    reason = ranks.stop_reason
    if reason == _core.StopReason.TIMEOUT:
        running = list(ranks.ranks_running_at_timeout)
        stacks, missing = timeout_report.split(running)
        raise RunTimeoutError(
            _timeout_message(name, timeout, running, stacks, missing, paths),
            running_ranks=running,
            stacks=stacks,
            missing_stacks=missing,
        )
    if reason == _core.StopReason.RANK_FAILED:
        error = _root_cause(ranks.first_failed_rank, ranks, paths, mux)
        peers = failure_peers.note(ranks.first_failed_rank, world_size, paths.directory, ranks.failure_evidence)
        if peers is not None:
            error.add_note(peers)
        raise error from error.__cause__
    if not returns_values:
        return [None] * world_size
    results = []
    for rank in range(world_size):
        try:
            with paths.open_result(rank) as file:
                results.append(result_file.read(file, paths.result(rank)))
        except FileNotFoundError:
            raise RankFailedError(
                f"Rank {rank} of {world_size} (pid {ranks.pid(rank)}) returned, but its result file "
                f"{paths.result(rank)} is gone: was the run directory removed during the call?\nFull log: {paths.log(rank)}",
                rank=rank,
                pid=ranks.pid(rank),
                exit_code=0,
                log_path=str(paths.log(rank)),
                log_tail=list(mux.stderr_tails[rank]),
            ) from None
    return results



def _root_cause(rank: int, ranks, paths: RunPaths, mux: OutputMux) -> BaseException:
    world_size = ranks.world_size
    pid = ranks.pid(rank)
    log = str(paths.log(rank))
    where = ranks.location(rank)  # "pid 123", and the node where there are several
    who = f"Rank {rank} of {world_size} ({where})"
    tail = list(mux.stderr_tails[rank])
    common = dict(rank=rank, pid=pid, log_path=log, log_tail=tail)
    envelope = _load_envelope(paths.error(rank))
    if envelope is not None:
        remote = RemoteTraceback(f"\n\nTraceback from rank {rank} ({where}):\n{_format_remote(envelope)}")
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
        _label(exception, rank, world_size, where, log)
        exception.__cause__ = remote
        return exception
    code, signo = ranks.exit_status(rank)
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



class TimeoutReport:
    """What the ranks still running at a timeout left: each one's dumped stack, or why none came."""

    def __init__(self, python: bool) -> None:
        self._python = python
        self._captured: dict[int, list[str]] = {}
        self._obstacles: dict[int, str] = {}

    def start(self, ranks, mux: OutputMux) -> None:
        self._captured = mux.capture_stderr()
        if self._python:
            for rank in ranks.ranks_running_at_timeout:
                obstacle = ranks.stack_dump_obstacle(rank)
                if obstacle is not None:
                    self._obstacles[rank] = obstacle

    def split(self, running: list[int]) -> tuple[dict[int, list[str]], dict[int, str]]:
        """(the stacks dumped, by rank; why each other running rank has none)."""
        stacks, missing = {}, {}
        for rank in running:
            lines = self._captured.get(rank, [])
            if any(STACK_HEADER in line for line in lines):
                stacks[rank] = lines
            elif not self._python:
                missing[rank] = "a native program has no Python stack to dump"
            else:
                missing[rank] = self._obstacles.get(
                    rank, f"it wrote no stack within {STACK_DUMP_WAIT_S:g} s of {STACK_DUMP_SIGNAL.name}"
                )
        return stacks, missing




def _format_remote(envelope: dict) -> str:
    """The rank's traceback with source lines looked up here, where a notebook's cells are known."""
    frames = envelope.get("frames")
    if not frames:
        return envelope["traceback"]
    summary = traceback.StackSummary.from_list([(f, n, name, None) for f, n, name in frames])
    return "Traceback (most recent call last):\n" + "".join(summary.format()) + envelope["exception_only"]



def _label(exception: BaseException, rank: int, world_size: int, where: str, log: str) -> None:
    """Names the rank in the message where the message is a plain string, and in a note always."""
    args = exception.args
    if type(exception).__str__ is BaseException.__str__ and len(args) == 1 and isinstance(args[0], str):
        exception.args = (f"[rank {rank}] {args[0]}",)
    exception.add_note(f"fanrun: raised on rank {rank} of {world_size} ({where}); full log: {log}")



def _load_envelope(path: Path) -> dict | None:
    """The rank's error envelope; None where it wrote none, or one without the contract's keys
    (the rank is then reported by its exit status and its log)."""
    try:
        with open(path, "rb") as file:
            envelope = pickle.load(file)
    except FileNotFoundError:
        return None
    if not isinstance(envelope, dict) or set(envelope) != set(ENVELOPE_KEYS) or envelope["kind"] not in ENVELOPE_KINDS:
        return None
    return envelope



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

