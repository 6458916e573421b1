"""What the peers of a failed rank were doing when it failed: a peer waiting in a collective was
waiting for the failed rank, and its own error ("Connection reset by peer") is a consequence, not
the cause. Read from their progress records (_rank/progress.py), which see the collectives that
Python calls, and else from what their flight recorders held when the failure came
(rank_evidence.collectives_now): DDP's gradient all-reduces are no Python call."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .._rank import contract
from ..backends import rank_evidence
from .stall_report import RankProgress
from .verdict import flight_recorder_entries, flight_recorder_op, group_label


def note(failed_rank: int, world_size: int, directory: Path, asked: Mapping[int, float] | None = None) -> str | None:
    """One sentence naming the peers that waited in a collective or for data; None where none did.
    `asked`: the peers asked for their collectives when the failure came, and when (Ranks.failure_evidence)."""
    asked = asked or {}
    waiting: dict[str, list[int]] = {}
    for rank in range(world_size):
        if rank == failed_rank:
            continue
        progress = RankProgress.read(directory / contract.progress_name(rank), rank)
        if progress is not None and progress.state == "collective":
            waiting.setdefault(f"in {progress.op} #{progress.collectives}", []).append(rank)
        elif progress is not None and progress.state == "data":
            waiting.setdefault("in DataLoader.__next__", []).append(rank)
        elif rank in asked and (where := _recorded_wait(directory / contract.forensics_collectives_name(rank),
                                                        asked[rank])):
            waiting.setdefault(where, []).append(rank)
    if not waiting:
        return None
    parts = [f"{_ranks(ranks)} {'was' if len(ranks) == 1 else 'were'} waiting {where}" for where, ranks in waiting.items()]
    return f"fanrun: when rank {failed_rank} failed, {_join(parts)}: their errors follow from its failure."


def _recorded_wait(path: Path, since: float) -> str | None:
    """`in all_reduce #57 of group 0`, labelled as the stall verdict labels it: the newest
    collective a rank's flight recorder held unfinished (not retired) when it answered at `since`
    or later; None where it held none, or gave no such answer."""
    answer = rank_evidence.collectives(path)
    if answer is None or answer[0] < since - 1e-3:
        return None
    pending = [(key, entry) for key, entry in flight_recorder_entries(answer[1]).items()
               if entry.get("retired") is False]
    if not pending:
        return None
    (group, seq), entry = pending[-1]
    return f"in {flight_recorder_op(entry)} {group_label(group, seq)}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_join([str(rank) for rank in ranks])}"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
