"""Which files a rank and a DataLoader worker read, from (seed, epoch) alone: no sampler.

An epoch is one permutation of the files. Its progress is a single number, the global
offset: how many entries of the permutation every rank together has consumed. It does not
depend on the world size or on num_workers, which is what lets a run resume with either
changed:

- the entries not yet consumed, permutation[offset:], are dealt to the ranks in turn
  (entry i to rank i % world_size), padded with repeats of their own first entries up to a
  multiple of world_size, or cut down to one (drop_last), so every rank gets the same count;
- within a rank, its entries are cut into chunks of the DataLoader's batch size and chunk j
  goes to worker j % num_workers. torch's DataLoader takes batches from its workers in that
  same turn, so the main process sees the rank's entries in order, and "k samples consumed
  on every rank" is exactly the offset + k * world_size of the permutation.
"""

from __future__ import annotations

import random


def permutation(num_files: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(num_files))
    if shuffle:
        # Seeded from both numbers, so that every epoch has an order of its own.
        random.Random(f"fanrun.data:{seed}:{epoch}").shuffle(order)
    return order


def per_rank_count(remaining: int, world_size: int, drop_last: bool) -> int:
    if drop_last:
        return remaining // world_size
    return -(-remaining // world_size)


def rank_entries(order: list[int], offset: int, rank: int, world_size: int, drop_last: bool) -> list[int]:
    """The entries of `order` this rank reads, in order, from global offset `offset` on."""
    remaining = order[offset:]
    count = per_rank_count(len(remaining), world_size, drop_last)
    dealt = count * world_size
    if dealt > len(remaining):
        # Padding: repeats of the first remaining entries, as few as make the counts equal.
        padded = remaining + [remaining[i % len(remaining)] for i in range(dealt - len(remaining))]
    else:
        padded = remaining[:dealt]
    return padded[rank::world_size]


def worker_entries(entries: list[int], worker: int, num_workers: int, chunk: int) -> list[int]:
    """The part of a rank's entries one DataLoader worker reads: every num_workers-th chunk."""
    out: list[int] = []
    for start in range(worker * chunk, len(entries), num_workers * chunk):
        out.extend(entries[start : start + chunk])
    return out


def offset_after(offset: int, consumed_per_rank: int, world_size: int, num_files: int) -> int:
    """The global offset once every rank has consumed `consumed_per_rank` entries from `offset`;
    past the end (padding) it is the end."""
    return min(offset + consumed_per_rank * world_size, num_files)
