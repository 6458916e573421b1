"""The agents' news through srun's stdout (backends/slurm/wire.py): srun keeps a line whole only up
to 1024 bytes, and cuts a longer one into pieces that mix with other nodes' lines. Each item goes
in lines short enough, joined again per node, and a line that does not read is said, not lost."""

from __future__ import annotations

import pytest

from fanrun.backends.slurm import wire


def test_every_line_of_a_large_item_fits_what_srun_keeps_whole():
    lines = wire.news_lines(12, ("batch", ["x" * 50_000])).splitlines(keepends=True)
    assert len(lines) > 50
    assert max(len(line) for line in lines) == wire.LINE_LIMIT


def test_two_nodes_lines_interleaved_are_joined_into_each_nodes_items():
    first = wire.news_lines(0, ("batch", ["a" * 5000])).splitlines(keepends=True)
    second = wire.news_lines(1, ("batch", ["b" * 7000])).splitlines(keepends=True)
    mixed = [line for pair in zip(first, second) for line in pair] + first[len(second):] + second[len(first):]
    news = wire.News()
    items = [found for found in map(news.read, mixed) if found is not None and found[1] is not None]
    assert sorted(items) == [(0, ("batch", ["a" * 5000])), (1, ("batch", ["b" * 7000]))]


def test_a_line_cut_short_is_an_error_naming_its_node_and_others_lines_are_not_the_agents():
    news = wire.News()
    line = wire.news_lines(3, ("hello", {"name": "n"}))
    with pytest.raises(wire.GarbledNews) as info:
        news.read(line[:20] + b"\n")  # cut inside the base64: it does not decode
    assert info.value.node == 3
    assert news.read(b"a line of srun's own\n") is None
