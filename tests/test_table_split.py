"""TableDataset's split (_table_split.py) over many random layouts: every rank the same count,
every row once (or a few fewer than the world size left out with drop_last), the main process
seeing its rank's span in order whatever its number of workers, and a resume with another world
size and other workers reading exactly what was not consumed."""

from __future__ import annotations

import random

import pytest

from fanrun.data import _table_split as split


def main_process_rows(work, world_size, rank, workers, batch_rows, drop_last):
    """What the rank's main process receives: batch j from worker j % workers, as torch's DataLoader takes them."""
    span, own = split.rank_span(work, rank, world_size, drop_last)
    rows = split.total(span)
    parts = [[p for a, b in split.worker_part(span, rows, w, workers, batch_rows) for p in range(a, b)]
             for w in range(max(1, workers))]
    received, taken = [], [0] * len(parts)
    for batch in range(-(-rows // batch_rows)):
        worker = batch % len(parts)
        received.extend(parts[worker][taken[worker]:taken[worker] + batch_rows])
        taken[worker] += batch_rows
    assert received == [p for a, b in span for p in range(a, b)]  # the span, in order
    return received, own


@pytest.mark.parametrize("seed", range(4))
def test_every_row_once_equal_counts_and_exact_resume_over_random_layouts(seed):
    rng = random.Random(seed)
    for _ in range(500):
        rows = rng.randint(0, 60)
        work = [(0, rows)] if rows else []
        world_size, drop_last, batch_rows = rng.randint(1, 4), rng.random() < 0.3, rng.randint(1, 5)
        streams = [main_process_rows(work, world_size, rank, rng.randint(0, 3), batch_rows, drop_last)
                   for rank in range(world_size)]
        seen = [p for received, _ in streams for p in received]
        assert {len(received) for received, _ in streams} <= {split.per_rank_count(rows, world_size, drop_last)}
        if drop_last:
            assert len(set(seen)) == len(seen) and rows - len(seen) < world_size
        else:
            assert set(seen) == set(range(rows)) and len(seen) - rows < world_size
        consumed_per_rank = rng.randint(0, split.per_rank_count(rows, world_size, drop_last))
        consumed = {p for received, own in streams for p in received[:min(consumed_per_rank, own)]}
        left = split.remaining_after(work, world_size, drop_last, consumed_per_rank)
        assert {p for a, b in left for p in range(a, b)} == set(seen) - consumed
        again = rng.randint(1, 4)
        resumed = [p for rank in range(again)
                   for p in main_process_rows(left, again, rank, rng.randint(0, 3), rng.randint(1, 5), False)[0]]
        assert set(resumed) == set(seen) - consumed
