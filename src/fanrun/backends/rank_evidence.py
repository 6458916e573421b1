"""The evidence of a stalled call, asked of the ranks of this machine without stopping them: every
backend asks on the machine where its ranks run (a node's agent for its own).
- every thread's stack, the main thread's frames and the flight recorder's last collectives,
  which the rank's forensics thread writes when asked on its FIFO (it needs the GIL);
- from a rank that gives no answer in ANSWER_S (its GIL is held), every thread's stack, which its
  faulthandler writes into its stacks file on FORENSICS_SIGNAL without the GIL. A rank is
  signalled only then: faulthandler reads the threads unlocked, and a thread that runs Python
  meanwhile, as the forensics thread does while it answers, crashes the rank;
- its last lines of output.
The launcher judges it (_launch/forensics.py, verdict.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .._file_changes import FileChanges
from .._rank import contract
from .._spec.paths import rank_log
from .stack_dump import DumpReader, send_signal, start_time

# How long the ranks get to answer before the silent ones are signalled, how long they get in
# all, and how long a stacks file may pause before its dump counts as done.
ANSWER_S = 1.0
WAIT_S = 3.0
QUIET_S = 0.2
LAST_LINES = 5
# How often a watched call's ranks are asked for their flight recorder's collectives (the
# straggler watch's view of DDP's all-reduces): each ask costs a rank one dump of its recorder.
COLLECTIVES_EVERY_S = 2.0


@dataclasses.dataclass(frozen=True)
class RankAnswer:
    """What one running rank gave when asked."""

    stack: str  # every thread's stack as faulthandler wrote it; "" where none came
    answer: dict | None  # its forensics thread's answer (main_stack, collectives); None: none came
    last_lines: tuple[str, ...]
    unasked: str = ""  # why it could not be asked, where it could not: nothing above is evidence then


def ask(directory: Path, ranks: Sequence[int], running: Mapping[int, int]) -> dict[int, RankAnswer]:
    """What each of `ranks`, whose files are in `directory`, gave: the running ones (rank -> pid)
    asked at once, the silent ones among them signalled after ANSWER_S, all waited for WAIT_S at
    most; an ended one's last lines alone. A rank without a FIFO (no forensics thread, so no
    handler for the signal either) gives its last lines alone."""
    answers = {rank: directory / contract.forensics_answer_name(rank) for rank in running}
    dumps = DumpReader({rank: directory / contract.forensics_stacks_name(rank) for rank in running})
    asked_at = time.time()
    evidence: dict[int, dict] = {}
    with FileChanges([], [str(directory)]) as changes:
        asked = [rank for rank in running if _ask(directory / contract.forensics_ask_name(rank))]
        start = time.monotonic()
        signal_at, deadline = start + ANSWER_S, start + WAIT_S
        signalled = False
        while True:
            for rank in asked:
                if rank not in evidence and (answer := _fresh_answer(answers[rank], asked_at)) is not None:
                    evidence[rank] = answer
            silent = [rank for rank in asked if rank not in evidence]
            now = time.monotonic()
            if not signalled and silent and now >= signal_at:
                dumps.watch(rank for rank in silent if send_signal(
                    running[rank], start_time(running[rank]), contract.FORENSICS_SIGNAL) is None)
                signalled = True
            dumps.read()
            dumped = signalled and dumps.quiet_s() >= QUIET_S and dumps.holds_stacks(silent)
            if now >= deadline or not silent or dumped:
                break
            changes.wait(min(deadline - now, QUIET_S) if signalled else signal_at - now)
    texts = dumps.texts()
    return {rank: RankAnswer(stack=_stack(evidence.get(rank), texts.get(rank, "")), answer=evidence.get(rank),
                             last_lines=tuple(last_lines(rank_log(directory, rank))))
            for rank in ranks}


def ask_for_collectives(directory: Path, ranks: Iterable[int]) -> None:
    """Asks each of `ranks` for its flight recorder's collectives, without waiting: each answers
    into its forensics_collectives_name file in `directory`, which collectives() reads."""
    for rank in ranks:
        _ask(directory / contract.forensics_ask_name(rank), contract.FORENSICS_ASK_COLLECTIVES)


def collectives_now(directory: Path, ranks: Iterable[int], within_s: float) -> dict[int, float]:
    """Asks each of `ranks` for its flight recorder's collectives and waits, `within_s` at most,
    for every rank asked to answer (one whose main thread holds the GIL cannot); returns the ranks
    asked (those with a forensics thread) and when (time.time()), so that collectives() tells their
    answers from older ones."""
    asked_at = time.time()
    paths = {rank: directory / contract.forensics_collectives_name(rank) for rank in ranks}
    deadline = time.monotonic() + within_s
    with FileChanges([], [str(directory)]) as changes:
        asked = [rank for rank in paths if _ask(directory / contract.forensics_ask_name(rank),
                                                contract.FORENSICS_ASK_COLLECTIVES)]
        waiting = asked
        while waiting and (left := deadline - time.monotonic()) > 0:
            changes.wait(left)
            waiting = [rank for rank in waiting if _fresh_answer(paths[rank], asked_at) is None]
    return dict.fromkeys(asked, asked_at)


def collectives(path: Path) -> tuple[float, list[dict]] | None:
    """A rank's last answer with its collectives: (when it was written, the collectives); None
    before its first, or where its flight recorder keeps none."""
    answer = _answer(path)
    if answer is None or not isinstance(answer.get("collectives"), list):
        return None
    return float(answer.get("time", 0.0)), [entry for entry in answer["collectives"] if isinstance(entry, dict)]


def _stack(answer: dict | None, dumped: str) -> str:
    """A rank's stacks: its forensics thread's, else what its faulthandler dumped."""
    given = answer.get("stacks") if answer is not None else None
    return given if isinstance(given, str) else dumped


def _ask(fifo: Path, line: bytes = contract.FORENSICS_ASK_EVIDENCE) -> bool:
    """Writes one line to the rank's FIFO; False where it has none (a native program's rank)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.geteuid():
            return False
        os.write(fd, line)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _fresh_answer(path: Path, asked_at: float) -> dict | None:
    answer = _answer(path)
    if answer is None or not answer.get("time", 0) >= asked_at - 1e-3:
        return None
    return answer


def _answer(path: Path) -> dict | None:
    """A rank's answer file (JSON, written whole by the rank), read without following a link;
    None where there is none, or it is not an object."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        try:
            answer = json.loads(file.read())
        except ValueError:
            return None
    return answer if isinstance(answer, dict) else None


def last_lines(path: Path, count: int = LAST_LINES) -> list[str]:
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
            file.seek(max(file.seek(0, os.SEEK_END) - 8192, 0))
            tail = file.read()
    except OSError:
        return []
    lines = [line for line in tail.decode("utf-8", "replace").split("\n") if line.strip()]
    return [line[:300] for line in lines[-count:]]


def unasked(ranks: Sequence[int], why: str) -> dict[int, RankAnswer]:
    return {rank: RankAnswer(stack="", answer=None, last_lines=(), unasked=why) for rank in ranks}
