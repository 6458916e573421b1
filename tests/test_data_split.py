"""The split of an epoch across ranks and DataLoader workers, and resuming it by a global
offset: every file once per epoch, equal counts per rank, any world size or num_workers."""

from __future__ import annotations

import collections
import itertools

import pytest

from fanrun.data import _split


def read_epoch(num_files, world_size, workers_per_rank, chunk, *, seed=0, epoch=0, offset=0, drop_last=False):
    """What each rank's main process receives, in order, as torch's DataLoader hands it
    batches from its workers in turn."""
    order = _split.permutation(num_files, seed, epoch, shuffle=True)
    received = []
    for rank in range(world_size):
        entries = _split.rank_entries(order, offset, rank, world_size, drop_last)
        workers = workers_per_rank[rank]
        if workers == 0:
            received.append(entries)
            continue
        batches = [
            [part[i : i + chunk] for i in range(0, len(part), chunk)]
            for part in (_split.worker_entries(entries, w, workers, chunk) for w in range(workers))
        ]
        # The DataLoader's turn: worker 0's first batch, worker 1's first, ..., skipping spent workers.
        in_turn = [b for group in itertools.zip_longest(*batches) for b in group if b is not None]
        received.append([entry for batch in in_turn for entry in batch])
        assert received[-1] == entries, "the main process must see the rank's entries in order"
    return order, received


@pytest.mark.parametrize("world_size,workers", [(1, [0]), (2, [2, 2]), (3, [1, 4, 0]), (4, [2, 3, 2, 1])])
@pytest.mark.parametrize("num_files", [1, 7, 24, 101])
def test_every_file_once_per_epoch_and_equal_counts(num_files, world_size, workers):
    _, received = read_epoch(num_files, world_size, workers, chunk=3)
    counts = {len(r) for r in received}
    assert len(counts) == 1, "every rank must read as many samples, or DDP hangs"
    seen = collections.Counter(e for r in received for e in r)
    assert set(seen) == set(range(num_files))
    padding = sum(seen.values()) - num_files
    assert 0 <= padding < world_size

    _, dropped = read_epoch(num_files, world_size, workers, chunk=3, drop_last=True)
    kept = [e for r in dropped for e in r]
    assert len(kept) == len(set(kept)) == num_files - num_files % world_size


def test_epochs_reshuffle_and_are_reproducible():
    first = _split.permutation(50, seed=1, epoch=0, shuffle=True)
    assert first == _split.permutation(50, seed=1, epoch=0, shuffle=True)
    assert first != _split.permutation(50, seed=1, epoch=1, shuffle=True)
    assert first != _split.permutation(50, seed=2, epoch=0, shuffle=True)
    assert _split.permutation(5, seed=1, epoch=3, shuffle=False) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("before,after", [((2, [2, 2]), (3, [1, 0, 4])), ((4, [1, 1, 1, 1]), (2, [3, 2])), ((3, [2, 2, 2]), (3, [1, 1, 1]))])
def test_resume_from_a_global_offset_with_another_world_size_or_workers(before, after):
    num_files, steps = 103, 5
    world_size, workers = before
    order, received = read_epoch(num_files, world_size, workers, chunk=4, epoch=2)
    consumed = [r[: steps * 4] for r in received]  # 5 batches of 4 on every rank
    offset = _split.offset_after(0, steps * 4, world_size, num_files)
    new_world, new_workers = after
    _, resumed = read_epoch(num_files, new_world, new_workers, chunk=4, epoch=2, offset=offset)
    first = collections.Counter(e for r in consumed for e in r)
    second = collections.Counter(e for r in resumed for e in r)
    assert max(first.values()) == 1 and not set(first) & set(second), "nothing consumed is read again"
    assert set(first) | set(second) == set(range(num_files)), "nothing is skipped"
    assert sum(second.values()) - len(second) < new_world  # only the documented padding repeats
    assert len({len(r) for r in resumed}) == 1
