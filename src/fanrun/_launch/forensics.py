"""The evidence of a stalled call, gathered from every rank of this machine without stopping it:
- every thread's stack, which the rank's faulthandler writes into its stacks file on
  FORENSICS_SIGNAL (it needs no GIL);
- the flight recorder's last collectives and the main thread's frames, which the rank's
  forensics thread writes when asked on its FIFO (it needs the GIL: no answer is evidence too);
- its progress record, read afresh, and its last lines of output."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from .._rank import contract
from .._spec.paths import RunPaths, rank_log
from .file_changes import FileChanges
from .outcome import STACK_HEADER
from .running_calls import start_time
from .stacks import file_size, read_from, send_signal
from .stall_report import RankEvidence, RankProgress
from .verdict import parse_stack

# How long the ranks get to write their stacks and to answer, and how long a stacks file may
# pause before its dump counts as done.
WAIT_S = 3.0
QUIET_S = 0.2
LAST_LINES = 5


def gather(paths: RunPaths, ranks, ended: Collection[int], progress: Sequence[RankProgress | None]) -> list[RankEvidence]:
    directory = paths.directory
    running = [rank for rank in range(ranks.world_size) if rank not in ended]
    stacks = {rank: directory / contract.forensics_stacks_name(rank) for rank in running}
    answers = {rank: directory / contract.forensics_answer_name(rank) for rank in running}
    offsets = {rank: file_size(path) for rank, path in stacks.items()}
    asked_at = time.time()
    with FileChanges([], [str(directory)]) as changes:
        asked = [rank for rank in running if _ask(directory / contract.forensics_ask_name(rank))]
        signalled = []
        for rank in running:
            pid = ranks.pid(rank)
            if send_signal(pid, start_time(pid), contract.FORENSICS_SIGNAL) is None:
                signalled.append(rank)
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
    out = []
    for rank in range(ranks.world_size):
        text = texts.get(rank, "")
        answer = evidence.get(rank, {})
        frames = tuple(tuple(frame) for frame in answer.get("main_stack", ())) or parse_stack(text)
        fresh = RankProgress.read(directory / contract.progress_name(rank), rank)
        collectives = answer.get("collectives")
        out.append(RankEvidence(
            rank=rank, progress=fresh or progress[rank], running=rank in running, stack=text, main_frames=frames,
            answered=rank in evidence, collectives=tuple(collectives) if collectives is not None else None,
            last_lines=tuple(_last_lines(rank_log(directory, rank)))))
    return out


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


def _last_lines(path: Path, count: int = LAST_LINES) -> list[str]:
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
            file.seek(max(file.seek(0, os.SEEK_END) - 8192, 0))
            tail = file.read()
    except OSError:
        return []
    lines = [line for line in tail.decode("utf-8", "replace").split("\n") if line.strip()]
    return [line[:300] for line in lines[-count:]]

