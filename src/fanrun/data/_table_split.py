"""Which rows of a table a rank and a DataLoader worker read, from (seed, epoch) alone: no sampler.

An epoch's order is a permutation of the table's row groups (pieces), drawn from (seed, epoch);
its rows, concatenated in that order, are numbered 0..N-1. A pass reads its *work*: intervals
[a, b) of those numbers, in order. A fresh epoch's work is [(0, N)].

- The work's rows are cut into one contiguous span per rank, all of the same length: padded at
  the end with repeats of the work's first rows (fewer than the world size in all), or, with
  drop_last, shortened to whole shares. A rank so reads whole row groups, but for the one or two
  its span shares with its neighbours.
- Within a rank, batch j of the span goes to DataLoader worker j % num_workers, which is the
  order torch's DataLoader takes them in: the main process sees the span in order. A worker keeps
  the row group it is in, so it reads each of its rank's row groups once.
- Progress is the work not consumed yet: the rest of every rank's span after the rows its main
  process received (the same number on every rank). It is a list of intervals of the epoch's
  order, which any world size and number of workers can read, so a run resumes with either
  changed.
"""

from __future__ import annotations

from collections.abc import Sequence

Interval = tuple[int, int]


def total(work: Sequence[Interval]) -> int:
    return sum(b - a for a, b in work)


def cut(work: Sequence[Interval], start: int, length: int) -> list[Interval]:
    """The intervals of rows start..start+length of the work, counted along it."""
    out: list[Interval] = []
    position = 0
    end = start + length
    for a, b in work:
        size = b - a
        low, high = max(start, position), min(end, position + size)
        if low < high:
            out.append((a + low - position, a + high - position))
        position += size
        if position >= end:
            break
    return out


def per_rank_count(remaining: int, world_size: int, drop_last: bool) -> int:
    if drop_last:
        return remaining // world_size
    return -(-remaining // world_size)


def rank_span(work: Sequence[Interval], rank: int, world_size: int, drop_last: bool) -> tuple[list[Interval], int]:
    """The rank's rows, in order (padding included), and how many of them are its own (the rest repeat others')."""
    remaining = total(work)
    count = per_rank_count(remaining, world_size, drop_last)
    own = max(0, min(count, remaining - rank * count))
    span = cut(work, rank * count, own)
    # Padding: the rows after the work's end, had it wrapped around to its start (again, where
    # the work has fewer rows than the world size).
    position = max(rank * count, remaining) - remaining
    needed = count - own
    while needed > 0 and remaining:
        start = position % remaining
        taken = min(needed, remaining - start)
        span += cut(work, start, taken)
        position += taken
        needed -= taken
    return span, own


def worker_part(span: Sequence[Interval], rows: int, worker: int, num_workers: int, batch_rows: int) -> list[Interval]:
    """The rows one DataLoader worker reads of a rank's span: every num_workers-th batch of
    batch_rows rows, as torch's DataLoader takes batch j from worker j % num_workers; so the
    main process sees the span in order, whatever the number of workers."""
    workers = max(1, num_workers)
    part: list[Interval] = []
    for start in range(worker * batch_rows, rows, workers * batch_rows):
        part.extend(cut(span, start, min(batch_rows, rows - start)))
    return part


def remaining_after(work: Sequence[Interval], world_size: int, drop_last: bool, consumed: int) -> list[Interval]:
    """The work not consumed once every rank's main process has received `consumed` rows."""
    left: list[Interval] = []
    for rank in range(world_size):
        span, own = rank_span(work, rank, world_size, drop_last)
        if consumed < own:  # the rest of the rank's own rows; its padding repeats others'
            left.extend(cut(span, consumed, own - consumed))
    return merge(left)


def merge(intervals: Sequence[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
