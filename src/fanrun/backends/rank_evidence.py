"""The evidence of a stalled call, asked of the ranks of this machine without stopping them: every
backend asks on the machine where its ranks run (a node's agent for its own).
- every thread's stack, which the rank's faulthandler writes into its stacks file on
  FORENSICS_SIGNAL (it needs no GIL);
- the flight recorder's last collectives and the main thread's frames, which the rank's
  forensics thread writes when asked on its FIFO (it needs the GIL: no answer is evidence too);
- its last lines of output.
The launcher judges it (_launch/forensics.py, verdict.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._file_changes import FileChanges
from .._rank import contract
from .._spec.paths import rank_log
from .stack_dump import STACK_HEADER, file_size, read_from, send_signal, start_time

# How long the ranks get to write their stacks and to answer, and how long a stacks file may
# pause before its dump counts as done.
WAIT_S = 3.0
QUIET_S = 0.2
LAST_LINES = 5


@dataclasses.dataclass(frozen=True)
class RankAnswer:
    """What one running rank gave when asked."""

    stack: str  # every thread's stack as faulthandler wrote it; "" where none came
    answer: dict | None  # its forensics thread's answer (main_stack, collectives); None: none came
    last_lines: tuple[str, ...]
    unasked: str = ""  # why it could not be asked, where it could not: nothing above is evidence then


def ask(directory: Path, ranks: Sequence[int], running: Mapping[int, int]) -> dict[int, RankAnswer]:
    """What each of `ranks`, whose files are in `directory`, gave: the running ones (rank -> pid)
    asked at once, waited for at most WAIT_S; an ended one's last lines alone."""
    stacks = {rank: directory / contract.forensics_stacks_name(rank) for rank in running}
    answers = {rank: directory / contract.forensics_answer_name(rank) for rank in running}
    offsets = {rank: file_size(path) for rank, path in stacks.items()}
    asked_at = time.time()
    with FileChanges([], [str(directory)]) as changes:
        asked = [rank for rank in running if _ask(directory / contract.forensics_ask_name(rank))]
        signalled = [rank for rank, pid in running.items()
                     if send_signal(pid, start_time(pid), contract.FORENSICS_SIGNAL) is None]
        texts = dict.fromkeys(signalled, "")
        evidence: dict[int, dict] = {}
        deadline = time.monotonic() + WAIT_S
        last_growth = time.monotonic()
        while True:
            for rank in signalled:
                more = read_from(stacks[rank], offsets[rank] + len(texts[rank].encode()))
                if more:
                    texts[rank] += more.decode("utf-8", "replace")
                    last_growth = time.monotonic()
            for rank in asked:
                if rank not in evidence:
                    answer = _fresh_answer(answers[rank], asked_at)
                    if answer is not None:
                        evidence[rank] = answer
            now = time.monotonic()
            stacks_done = all(STACK_HEADER in texts[rank] for rank in signalled) and now - last_growth >= QUIET_S
            if now >= deadline or (stacks_done and len(evidence) == len(asked)):
                break
            changes.wait(min(deadline - now, QUIET_S))
    return {rank: RankAnswer(stack=texts.get(rank, ""), answer=evidence.get(rank),
                             last_lines=tuple(last_lines(rank_log(directory, rank))))
            for rank in ranks}


def _ask(fifo: Path) -> bool:
    """Writes one line to the rank's FIFO; False where it has none (a native program's rank)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.geteuid():
            return False
        os.write(fd, b"ask\n")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _fresh_answer(path: Path, asked_at: float) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        try:
            answer = json.loads(file.read())
        except ValueError:
            return None
    if not isinstance(answer, dict) or not answer.get("time", 0) >= asked_at - 1e-3:
        return None
    return answer


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
