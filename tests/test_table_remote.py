"""TableDataset over HTTP from a real nginx on 127.0.0.1: a hive-partitioned Parquet table whose
footers are read in place and whose files come through the node's file cache, fetched once and
found again warm, pruned by a partition filter before any fetch and by a filter on another column
through the row groups' statistics, and named when one vanishes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from nginx_server import NginxServer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pc = pytest.importorskip("pyarrow.compute")
pytest.importorskip("aiohttp")

from fanrun._errors import TableError  # noqa: E402
from fanrun.data import DataLoader, TableDataset  # noqa: E402

DAYS = ("2026-11-29", "2026-11-30", "2026-12-01")
ROWS_PER_FILE = 250


def write_table(folder: Path) -> set[tuple[int, str]]:
    rows = set()
    for d, day in enumerate(DAYS):
        for part in range(2):
            ids = list(range((2 * d + part) * ROWS_PER_FILE, (2 * d + part + 1) * ROWS_PER_FILE))
            path = folder / f"day={day}" / f"part-{part}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"id": ids, "text": [f"row {i}" for i in ids]}), path, row_group_size=100)
            rows.update((i, day) for i in ids)
    (folder / "_SUCCESS").write_text("")
    return rows


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    rows = write_table(root / "events")
    server = NginxServer(root, tmp_path_factory.mktemp("nginx"))
    yield server, root, rows
    server.stop()


def fetched(dataset: TableDataset) -> dict:
    return dataset.source.remote._cache.get().stats()


def test_a_remote_table_is_read_through_the_cache_once_and_found_warm(served, tmp_path):
    server, _, rows = served
    dataset = TableDataset(f"{server.url}/events/", cache_dir=tmp_path / "cache", shuffle=True)
    assert dataset.num_rows == len(rows) and dataset.columns == ["id", "text", "day"]
    assert {(row["id"], row["day"]) for row in dataset} == rows
    assert all(row["text"] == f"row {row['id']}" for row in dataset)
    stats = fetched(dataset)
    assert stats["fetched"] == 2 * len(DAYS), stats
    assert stats["bytes_fetched"] == sum(p.stat().st_size for p in (served[1] / "events").rglob("*.parquet"))

    again = TableDataset(f"{server.url}/events/", cache_dir=tmp_path / "cache")
    assert sum(1 for _ in again) == len(rows)
    assert fetched(again)["fetched"] == 0 and fetched(again)["hits"] == 2 * len(DAYS)


def test_a_partition_filter_leaves_the_other_files_unfetched(served, tmp_path):
    server, _, rows = served
    dataset = TableDataset(f"{server.url}/events/", filter=pc.field("day") >= "2026-11-30", cache_dir=tmp_path / "c")
    assert {(row["id"], row["day"]) for row in dataset} == {r for r in rows if r[1] >= "2026-11-30"}
    assert fetched(dataset)["fetched"] == 4


def test_a_filter_on_a_plain_column_fetches_only_files_with_rows_that_pass(served, tmp_path):
    """The row groups are counted in place, once, when the table is opened: the files of the
    day whose ids the statistics rule out are never fetched; torch's workers read the rest."""
    import torch.utils.data

    server, _, rows = served
    where = (pc.field("day") >= "2026-11-30") & (pc.field("id") < 800)
    dataset = TableDataset(f"{server.url}/events/", filter=where, columns=["id"], batch_rows=32,
                           cache_dir=tmp_path / "c")
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    assert sorted(i for batch in loader for i in batch["id"].tolist()) == list(range(500, 800))
    assert dataset.num_rows == 300 and {dataset.source.files[p.file].partition["day"] for p in dataset.source.pieces} \
        == {"2026-11-30"}
    again = TableDataset(f"{server.url}/events/", filter=where, columns=["id"], cache_dir=tmp_path / "c")
    assert sorted(row["id"] for row in again) == list(range(500, 800))
    assert fetched(again)["fetched"] == 0 and fetched(again)["hits"] == 2  # the workers fetched those two


def test_workers_read_a_remote_table_exactly_once_in_batches(served, tmp_path):
    server, _, rows = served
    dataset = TableDataset(f"{server.url}/events/", batch_rows=64, cache_dir=tmp_path / "cache")
    ids = [i for batch in DataLoader(dataset, batch_size=None, num_workers=2) for i in batch["id"].tolist()]
    assert sorted(ids) == sorted(i for i, _ in rows)


def test_a_file_that_vanishes_from_the_server_is_named(served, tmp_path):
    server, root, _ = served
    copy = root / "vanishing"
    shutil.copytree(root / "events", copy)
    dataset = TableDataset(f"{server.url}/vanishing/", cache_dir=tmp_path / "cache", shuffle=False)
    gone = copy / f"day={DAYS[0]}" / "part-0.parquet"
    gone.unlink()
    with pytest.raises(TableError, match=f"{server.url}/vanishing/day={DAYS[0]}/part-0.parquet"):
        list(dataset)


def test_ranks_of_one_run_read_the_footers_once_per_node(served, tmp_path, monkeypatch):
    """The first rank of a run on a node asks the store for the footers and sizes; the others read
    its answer, so a footer broken after it is never seen by them, and is by another run."""
    server, root, rows = served
    copy = root / "shared"
    shutil.copytree(root / "events", copy)
    monkeypatch.setenv("FANRUN_RUN_ID", "run-a")
    first = TableDataset(f"{server.url}/shared/", cache_dir=tmp_path / "cache")
    broken = copy / f"day={DAYS[1]}" / "part-1.parquet"
    broken.write_bytes(b"not parquet" * 100)
    second = TableDataset(f"{server.url}/shared/", cache_dir=tmp_path / "cache")
    assert second.source.pieces == first.source.pieces and second.num_rows == len(rows)
    monkeypatch.setenv("FANRUN_RUN_ID", "run-b")
    with pytest.raises(TableError, match=f"its file {server.url}/shared/day={DAYS[1]}/part-1.parquet is not a readable"):
        TableDataset(f"{server.url}/shared/", cache_dir=tmp_path / "cache")

