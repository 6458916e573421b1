"""The evidence of a stalled call, gathered from every rank without stopping it: the backend asks
its ranks where they run (backends/rank_evidence.py: every thread's stack, the flight recorder's
last collectives and the main thread's frames, the last lines of output), and each rank's
progress record is read afresh."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .._rank import contract
from .._spec.paths import RunPaths
from .stall_report import RankEvidence, RankProgress
from .verdict import parse_stack


def gather(paths: RunPaths, ranks, ended: Collection[int], progress: Sequence[RankProgress | None]) -> list[RankEvidence]:
    answers = ranks.ask_for_evidence(ended)
    out = []
    for rank in range(ranks.world_size):
        given = answers.get(rank)
        answer = (given.answer if given is not None else None) or {}
        stack = given.stack if given is not None else ""
        frames = tuple(tuple(frame) for frame in answer.get("main_stack", ())) or parse_stack(stack)
        fresh = RankProgress.read(paths.directory / contract.progress_name(rank), rank)
        collectives = answer.get("collectives")
        out.append(RankEvidence(
            rank=rank, progress=fresh or progress[rank], running=rank not in ended, stack=stack, main_frames=frames,
            answered=given is not None and given.answer is not None,
            collectives=tuple(collectives) if collectives is not None else None,
            last_lines=given.last_lines if given is not None else (),
            unasked=given.unasked if given is not None else ""))
    return out
