"""What the peers of a failed rank were doing when it failed, from their progress records
(_rank/progress.py): a peer waiting in a collective was waiting for the failed rank, and its own
error ("Connection reset by peer") is a consequence, not the cause."""

from __future__ import annotations

from pathlib import Path

from .._rank import contract
from .stall_report import RankProgress


def note(failed_rank: int, world_size: int, directory: Path) -> str | None:
    """One sentence naming the peers that waited in a collective or for data; None where none did."""
    waiting: dict[str, list[int]] = {}
    for rank in range(world_size):
        if rank == failed_rank:
            continue
        progress = RankProgress.read(directory / contract.progress_name(rank), rank)
        if progress is None:
            continue
        if progress.state == "collective":
            waiting.setdefault(f"in {progress.op} #{progress.collectives}", []).append(rank)
        elif progress.state == "data":
            waiting.setdefault("in DataLoader.__next__", []).append(rank)
    if not waiting:
        return None
    parts = [f"{_ranks(ranks)} {'was' if len(ranks) == 1 else 'were'} waiting {where}" for where, ranks in waiting.items()]
    return f"fanrun: when rank {failed_rank} failed, {_join(parts)}: their errors follow from its failure."


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_join([str(rank) for rank in ranks])}"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
