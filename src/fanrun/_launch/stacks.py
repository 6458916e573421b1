"""The stacks of every rank of a running call, without stopping it: each rank is asked on its
FIFO, as a stall's evidence is, and one that has none (a native program's) dumps every thread's
stack on the stack-dump signal into its log, where they are read back. The ranks are the
processes ranks.json names, checked by their start time, and signalled through a pidfd, so that
a pid reused by another process is never signalled."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .._errors import FanrunError, StacksError, UnknownRunError, UnsafePathError
from .._private_dir import open_private
from .._rank.contract import STACK_DUMP_SIGNAL
from . import records, running_calls
from .._file_changes import FileChanges
from ..backends import rank_evidence
from ..backends.stack_dump import STACK_HEADER, DumpReader, send_signal, start_time
from .stall_report import REPORT_TEXT
from .._spec.paths import rank_log

# How long the ranks get to write their stacks, and how long a dump may pause between lines
# before it counts as done.
WAIT_S = 5.0
QUIET_S = 0.3


class Stacks:
    """Each rank's dumped stack (or why there is none), shown as text."""

    def __init__(self, run_id: str, by_rank: dict[int, str]) -> None:
        self.run_id = run_id
        self.by_rank = by_rank

    def __str__(self) -> str:
        return "\n".join(f"--- rank {rank} of run {self.run_id} ---\n{text.rstrip()}\n"
                         for rank, text in sorted(self.by_rank.items()))

    __repr__ = __str__


def stacks(run_id: str | None = None) -> Stacks:
    """fanrun.stacks(): the call running in this process (from another thread), or run_id's."""
    if run_id is not None:
        return of_run(run_id)
    running = running_calls.running()
    if not running:
        raise StacksError("No fanrun call is running in this process. Call fanrun.stacks() from another thread "
                          "while .distributed() runs, or from a shell: fanrun stacks RUN, with the run id the "
                          "call printed as it started (`fanrun list` shows the runs that run)")
    if len(running) > 1:
        raise StacksError(f"{len(running)} calls run in this process ({', '.join(sorted(running))}): "
                          f"name one, fanrun.stacks(run_id)")
    (only,) = running
    return of_run(only)


def of_run(run_id: str) -> Stacks:
    """The stacks of the ranks of run `run_id` (its record's id, blocking or detached), while it runs."""
    directory, dir_fd = _attempt_directory(run_id)
    try:
        ranks = _read_ranks(dir_fd, run_id)
    finally:
        os.close(dir_fd)
    if ranks["host"] != socket.gethostname():
        raise StacksError(f"run {run_id} runs on {ranks['host']}: run `fanrun stacks {run_id}` there")
    return Stacks(run_id, _dump(directory, [tuple(rank) for rank in ranks["ranks"]]))


def stall_report(run_id: str) -> str | None:
    """The run's last stall report as text (stall_outcome.py keeps it in the record), during the
    run and after; None where it has none, or the run is unknown."""
    try:
        data = records.RunRecord.find(run_id).read_bytes(REPORT_TEXT)
    except (FanrunError, OSError):
        return None
    return None if data is None else data.decode("utf-8", "replace")


def _attempt_directory(run_id: str) -> tuple[Path, int]:
    """The run directory of the run's attempt that runs now, as its record names it."""
    try:
        record = records.RunRecord.find(run_id)
        state = record.state()
    except UnknownRunError as error:
        raise StacksError(str(error)) from None
    except FanrunError as error:  # a damaged record
        raise StacksError(f"run {run_id}: {error}") from None
    if state["status"] != records.RUNNING:
        why = f": {state['reason'].splitlines()[0]}" if state.get("reason") else ""
        raise StacksError(f"run {run_id} is not running, it is {state['status']}{why}")
    found = record.run_directory()
    if found is None:
        raise StacksError(f"run {run_id}: its record names no run directory of fanrun's runs directory "
                          f"({state.get('run_dir')!r})")
    return found


def _read_ranks(dir_fd: int, run_id: str) -> dict:
    """The run's ranks.json, read without following a link, and checked: StacksError, saying
    what is wrong, for one that is missing or not as running_calls.add() writes it."""
    damaged = f"run {run_id}: its {running_calls.RANKS_FILE} is damaged"
    try:
        fd = open_private(dir_fd, running_calls.RANKS_FILE, os.O_RDONLY)
    except FileNotFoundError:
        raise StacksError(f"run {run_id}: its ranks are not running yet, or have ended (or they run on the nodes of "
                          f"a Ray cluster or a Slurm allocation, which `fanrun stacks` cannot reach yet; a stall's "
                          f"report and a timeout's dump hold every node's stacks)") from None
    except (UnsafePathError, OSError) as error:
        raise StacksError(f"{damaged} ({error})") from None
    with os.fdopen(fd, "rb") as file:
        data = file.read()
    try:
        ranks = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise StacksError(f"{damaged}: it is not JSON ({len(data)} bytes)") from None
    why = _what_is_wrong(ranks)
    if why is not None:
        raise StacksError(f"{damaged}: {why}")
    return ranks


def _what_is_wrong(record: object) -> str | None:
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    if not isinstance(record.get("host"), str):
        return "it names no host"
    ranks = record.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return "it lists no ranks"
    for rank, entry in enumerate(ranks):
        if not (isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0]) and entry[0] > 0
                and (entry[1] is None or _is_int(entry[1]))):
            return f"rank {rank} is not a [pid, start time] pair"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dump(directory: Path, ranks: list[tuple[int, int | None]]) -> dict[int, str]:
    """Each rank's stacks, asked as a stall's evidence is (rank_evidence.py signals only a rank
    that cannot answer: faulthandler's dump from a signal handler crashes a rank whose other thread
    runs Python meanwhile); a rank that has no FIFO to ask dumps into its log on STACK_DUMP_SIGNAL."""
    alive = {rank: pid for rank, (pid, started) in enumerate(ranks) if start_time(pid) == started}
    out = {rank: given.stack for rank, given in rank_evidence.ask(directory, list(alive), alive).items()
           if STACK_HEADER in given.stack}
    out.update(_dump_into_logs(directory, {rank: entry for rank, entry in enumerate(ranks) if rank not in out}))
    return out


def _dump_into_logs(directory: Path, ranks: dict[int, tuple[int, int | None]]) -> dict[int, str]:
    logs = {rank: rank_log(directory, rank) for rank in ranks}
    dumps = DumpReader(logs)
    out: dict[int, str] = {}
    with FileChanges([str(path) for path in logs.values() if path.exists()]) as changes:
        for rank, (pid, started) in ranks.items():
            why = send_signal(pid, started, STACK_DUMP_SIGNAL)
            if why is not None:
                out[rank] = f"(no stack: {why})"
        signalled = [rank for rank in ranks if rank not in out]
        dumps.watch(signalled)
        deadline = time.monotonic() + WAIT_S
        while True:
            dumps.read()
            now = time.monotonic()
            every_header = dumps.holds_stacks(signalled)
            if now >= deadline or (every_header and dumps.quiet_s() >= QUIET_S):
                break
            changes.wait(min(deadline - now, QUIET_S) if every_header else deadline - now)
    for rank, text in dumps.texts().items():
        out[rank] = text if STACK_HEADER in text else \
            f"(no stack within {WAIT_S:g} s of {STACK_DUMP_SIGNAL.name}: the rank blocks or ignores it)\n{text}"
    return out
