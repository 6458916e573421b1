"""TableDataset on real tables written here: Parquet with hive partitions, strings, lists and
nulls; Delta tables written with deltalake, with a deletion vector and several versions. Rows
and batches against the tables' own readers, every row once per epoch over 1-4 ranks with real
DataLoader workers, a run killed with SIGKILL and resumed on 3 ranks, and each bad input."""

from __future__ import annotations

import collections
import json
import shutil

import pyarrow as pa
import pyarrow.parquet
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest
import torch

from delta_tables import delete_rows, live_files
from fanrun import RankFailedError, distributed
from fanrun.data import DataLoader, TableDataset, TableError

deltalake = pytest.importorskip("deltalake")

ROWS = 200


def rows_of(n: int, first: int = 0) -> pa.Table:
    ids = range(first, first + n)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "day": [f"2026-11-{i % 3 + 28}" for i in ids],
        "text": [None if i % 7 == 0 else f"row {i}" for i in ids],
        "tags": [[f"t{i}"] * (i % 3) for i in ids],
        "vec": pa.array([[float(i), 0.5, -1.0] for i in ids], pa.list_(pa.float32(), 3)),
    })


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("parquet") / "table"
    # Row groups of at most 9 rows, uneven at the end of every file.
    ds.write_dataset(rows_of(ROWS), root, format="parquet", partitioning=["day"], partitioning_flavor="hive",
                     max_rows_per_group=9, min_rows_per_group=0, max_rows_per_file=40)
    return str(root)


@pytest.fixture(scope="module")
def delta(tmp_path_factory) -> dict:
    """Version 0: 120 rows in 3 files; 1: 80 more; 2: a deletion vector over the first file;
    3: a column added."""
    from deltalake import write_deltalake
    from deltalake.writer import WriterProperties

    root = str(tmp_path_factory.mktemp("delta") / "table")
    small_groups = WriterProperties(max_row_group_size=16)
    plain = rows_of(ROWS).drop_columns(["tags", "vec"])
    write_deltalake(root, plain.slice(0, 120), configuration={"delta.enableDeletionVectors": "true"},
                    writer_properties=small_groups, target_file_size=1)
    write_deltalake(root, plain.slice(120), mode="append", writer_properties=small_groups)
    first = sorted(live_files(root), key=lambda add: add["path"])[0]
    deleted = [0, 3, 17, 18, 19, 33]
    delete_rows(root, first, deleted)
    extra = plain.slice(0, 5).append_column("extra", pa.array(["x"] * 5))
    write_deltalake(root, extra.set_column(0, "id", pa.array(range(1000, 1005), pa.int64())), mode="append",
                    schema_mode="merge", writer_properties=small_groups)
    return {"root": root}


def reference(table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda row: row["id"])


def delta_rows(root: str, version: int | None = None) -> list[dict]:
    from deltalake import DeltaTable

    return reference(pa.RecordBatchReader.from_stream(DeltaTable(root, version=version).scan()).read_all())


# ---------------------------------------------------------------- what is read


def test_parquet_rows_are_the_tables_own_with_partition_values_nulls_and_lists(parquet):
    dataset = TableDataset(parquet, shuffle=False)
    assert dataset.num_rows == ROWS and dataset.columns == ["id", "text", "tags", "vec", "day"]
    expected = reference(ds.dataset(parquet, format="parquet", partitioning="hive").to_table())
    assert sorted(dataset, key=lambda row: row["id"]) == expected
    assert expected[7]["text"] is None and expected[5]["tags"] == ["t5", "t5"] and expected[1]["day"] == "2026-11-29"


def test_batches_are_tensors_where_arrow_allows_and_lists_otherwise(parquet):
    dataset = TableDataset(parquet, columns=["id", "vec", "text"], batch_rows=16, shuffle=False)
    batches = list(dataset)
    assert [len(b["id"]) for b in batches] == [16] * 12 + [8]
    first = batches[0]
    assert first["id"].dtype == torch.int64 and first["vec"].shape == (16, 3) and first["vec"].dtype == torch.float32
    assert isinstance(first["text"], list) and len(first["text"]) == 16
    ids = torch.cat([b["id"] for b in batches]).tolist()
    assert sorted(ids) == list(range(ROWS))
    vec = torch.cat([b["vec"] for b in batches])
    assert vec[:, 0].tolist() == [float(i) for i in ids] and set(vec[:, 1].tolist()) == {0.5}


def test_format_torch_batches_reach_the_rank_from_workers_in_one_shared_memory_block(tmp_path):
    import numpy

    n = 3000
    table = pa.table({"id": numpy.arange(n), "flag": numpy.arange(n) % 3 == 0, "half": numpy.ones(n, numpy.float16),
                      "vec": pa.FixedSizeListArray.from_arrays(pa.array(numpy.arange(2 * n, dtype=numpy.int32)), 2),
                      "maybe": [None if i % 5 == 0 else i for i in range(n)], "text": [f"row {i}" for i in range(n)]})
    pa.parquet.write_table(table, tmp_path / "t.parquet", row_group_size=700)
    dataset = TableDataset(str(tmp_path / "t.parquet"), format="torch", shuffle=False)
    assert dataset.batch_rows == 1024  # the default batch
    batches = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert sorted(torch.cat([b["id"] for b in batches]).tolist()) == list(range(n))
    for batch in batches:
        ids = batch["id"]
        assert list(batch) == ["id", "flag", "half", "vec", "maybe", "text"]  # the table's order
        assert batch["flag"].tolist() == (ids % 3 == 0).tolist() and batch["half"].dtype == torch.float16
        assert batch["vec"].shape == (len(ids), 2) and batch["vec"][:, 1].tolist() == (2 * ids + 1).tolist()
        assert batch["maybe"] == [None if i % 5 == 0 else i for i in ids.tolist()]  # nulls: a list
        assert batch["text"] == [f"row {i}" for i in ids.tolist()]
        tensors = [value for value in batch.values() if isinstance(value, torch.Tensor)]
        # One block for the whole batch, in shared memory: no tensor was pickled by value.
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1 and all(t.is_shared() for t in tensors)


def test_a_format_that_is_not_one_or_rows_with_a_batch_size_is_refused(parquet):
    with pytest.raises(ValueError, match=r"format must be one of 'rows', 'torch', not 'pandas'"):
        TableDataset(parquet, format="pandas")
    with pytest.raises(ValueError, match=r"format='rows' yields one row at a time, so batch_rows=8 has no meaning"):
        TableDataset(parquet, format="rows", batch_rows=8)
    assert next(iter(TableDataset(parquet, format="rows", columns=["id"]))).keys() == {"id"}
    assert TableDataset(parquet, batch_rows=8).format == "torch"


def test_a_partition_filter_prunes_files_and_a_missing_column_is_named_with_those_there_are(parquet):
    kept = TableDataset(parquet, filter=pc.field("day") == "2026-11-29", columns=["id"])
    assert sorted(row["id"] for row in kept) == [i for i in range(ROWS) if i % 3 == 1]
    assert all(kept.source.files[p.file].partition["day"] == "2026-11-29" for p in kept.source.pieces)
    with pytest.raises(TableError, match=r"the filter names 'label', which is not one of its columns; "
                                         r"those are id, text, tags, vec, day"):
        TableDataset(parquet, filter=(pc.field("label") > 3) & (pc.field("day") == "2026-11-29"))
    with pytest.raises(TableError, match=r"the filter cannot be applied to its columns .*'greater'"):
        TableDataset(parquet, filter=pc.field("id") > "3")


def test_delta_rows_honour_the_deletion_vector_and_versions_read_as_they_were(delta):
    root = delta["root"]
    latest = TableDataset(root, shuffle=False)
    assert sorted(latest, key=lambda row: row["id"]) == delta_rows(root)
    assert latest.num_rows == ROWS - 6 + 5
    assert any(file.keep is not None for file in latest.source.files)
    before_delete = TableDataset(root, version=1, shuffle=False)
    assert sorted(before_delete, key=lambda row: row["id"]) == delta_rows(root, 1) and before_delete.num_rows == ROWS
    assert "extra" not in before_delete.columns
    # Files written before the column was added read it as null.
    assert {row["extra"] for row in latest} == {None, "x"}


# ---------------------------------------------------------------- filters, against pyarrow's


@pytest.fixture(scope="module")
def parquet_file(tmp_path_factory) -> str:
    """One Parquet file, no partitions, ids in order over row groups of 10 (their statistics
    rule whole row groups out)."""
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("file") / "table.parquet"
    pq.write_table(rows_of(ROWS), path, row_group_size=10)
    return str(path)


@pytest.fixture(scope="module")
def delta_partitioned(tmp_path_factory) -> str:
    """A Delta table partitioned by day, with a deletion vector over one of its files."""
    from deltalake import write_deltalake
    from deltalake.writer import WriterProperties

    root = str(tmp_path_factory.mktemp("delta_partitioned") / "table")
    write_deltalake(root, rows_of(ROWS).drop_columns(["tags", "vec"]), partition_by=["day"],
                    configuration={"delta.enableDeletionVectors": "true"},
                    writer_properties=WriterProperties(max_row_group_size=16))
    delete_rows(root, sorted(live_files(root), key=lambda add: add["path"])[0], [0, 1, 2, 10, 40])
    return root


def all_rows(kind: str, path: str) -> pa.Table:
    if kind.startswith("delta"):
        from deltalake import DeltaTable

        table = pa.RecordBatchReader.from_stream(DeltaTable(path).scan()).read_all()
        # delta-rs gives strings as string_view, which pyarrow's comparisons with a str do not take.
        return table.cast(pa.schema([f.with_type(pa.string()) if f.type == pa.string_view() else f for f in table.schema]))
    return ds.dataset(path, format="parquet", partitioning="hive").to_table()


FILTERS = {
    "partition": pc.field("day") == "2026-11-29",
    "plain": pc.field("id") > 3,
    "plain, ruled out by statistics": (pc.field("id") >= 25) & (pc.field("id") < 57),
    "plain, nulls": pc.field("text").is_null(),
    "combined": (pc.field("day") == "2026-11-29") & (pc.field("id") > 100),
    "combined by or": (pc.field("day") == "2026-11-28") | (pc.field("id") < 20),
    "negated": ~(pc.field("id") > 50) & ~(pc.field("day") == "2026-11-30"),
}
# "day" is a partition column of the folder and of the partitioned Delta table, a plain one of the others.
TABLES = ["parquet file", "parquet folder", "delta", "delta partitioned"]


@pytest.fixture
def table(request, parquet, parquet_file, delta, delta_partitioned) -> tuple[str, str]:
    paths = {"parquet file": parquet_file, "parquet folder": parquet, "delta": delta["root"],
             "delta partitioned": delta_partitioned}
    return request.param, paths[request.param]


@pytest.mark.parametrize("table", TABLES, indirect=True)
@pytest.mark.parametrize("name", list(FILTERS))
def test_a_filter_on_any_column_gives_pyarrows_rows(table, name):
    kind, path = table
    expected = reference(all_rows(kind, path).filter(FILTERS[name]))
    assert expected, "a filter that leaves no row tests nothing"
    dataset = TableDataset(path, filter=FILTERS[name], shuffle=False)
    assert dataset.num_rows == len(expected)
    assert sorted(dataset, key=lambda row: row["id"]) == [{c: row[c] for c in dataset.columns} for row in expected]
    batches = list(TableDataset(path, filter=FILTERS[name], columns=["id"], batch_rows=7))
    assert sorted(i for batch in batches for i in batch["id"].tolist()) == [row["id"] for row in expected]


def test_statistics_rule_out_row_groups_before_any_row_is_counted(parquet_file):
    dataset = TableDataset(parquet_file, filter=FILTERS["plain, ruled out by statistics"], shuffle=False)
    assert [(p.row_group, p.rows) for p in dataset.source.pieces] == [(2, 5), (3, 10), (4, 10), (5, 7)]


@pytest.mark.parametrize("table", TABLES, indirect=True)
def test_a_filtered_table_is_read_once_over_ranks_and_workers(table, monkeypatch):
    kind, path = table
    where = FILTERS["combined by or"]
    expected = [row["id"] for row in reference(all_rows(kind, path).filter(where))]
    for world_size, workers in ((2, [2, 0]), (3, [1, 2, 0])):
        per_rank = read_as_ranks(path, world_size, workers, monkeypatch, filter=where)
        assert {len(ids) for ids in per_rank} == {-(-len(expected) // world_size)}
        seen = collections.Counter(i for ids in per_rank for i in ids)
        assert sorted(seen) == expected and sum(seen.values()) - len(expected) < world_size


# ---------------------------------------------------------------- over ranks and workers


def read_as_ranks(path: str, world_size: int, workers: list[int], monkeypatch, epoch: int = 0, **options) -> list[list[int]]:
    per_rank = []
    for rank in range(world_size):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        dataset = TableDataset(path, columns=["id"], seed=5, **options)
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=4, num_workers=workers[rank % len(workers)])
        per_rank.append([int(i) for batch in loader for i in batch["id"]])
    return per_rank


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [[2, 1], [2, 1, 0]])
def test_every_row_once_per_epoch_over_ranks_and_workers(parquet, monkeypatch, world_size, workers):
    per_rank = read_as_ranks(parquet, world_size, workers, monkeypatch)
    counts = {len(ids) for ids in per_rank}
    assert counts == {-(-ROWS // world_size)}  # the same on every rank
    seen = collections.Counter(i for ids in per_rank for i in ids)
    assert set(seen) == set(range(ROWS))
    assert sum(seen.values()) - ROWS < world_size  # the padding: fewer repeats than ranks


def test_epochs_reshuffle_and_drop_last_leaves_out_fewer_than_the_world_size(parquet, monkeypatch):
    first = read_as_ranks(parquet, 3, [2], monkeypatch, epoch=0)
    again = read_as_ranks(parquet, 3, [1], monkeypatch, epoch=0)
    second = read_as_ranks(parquet, 3, [2], monkeypatch, epoch=1)
    assert first == again and first != second
    dropped = read_as_ranks(parquet, 3, [2], monkeypatch, drop_last=True)
    ids = [i for rank in dropped for i in rank]
    assert len(ids) == len(set(ids)) == ROWS - ROWS % 3


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_rows, batch_size", [(None, None), (None, 4), (3, None)])
def test_torchs_own_dataloader_reads_every_row_once_over_ranks_and_workers(parquet, monkeypatch, workers, batch_rows,
                                                                             batch_size):
    """torch.utils.data.DataLoader, not fanrun's: each rank's span, split over its workers by
    get_worker_info(). Its workers raised TypeError (no pass begun by fanrun's loader)."""
    where = pc.not_equal(pc.bit_wise_and(pc.field("id"), 3), 0)
    expected = [i for i in range(ROWS) if i & 3]
    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dataset = TableDataset(parquet, columns=["id"], filter=where, batch_rows=batch_rows, seed=3)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)
        per_rank.append([int(i) for batch in loader for i in
                         (batch["id"] if batch_rows or batch_size else [batch["id"]])])
    assert len(per_rank[0]) == len(per_rank[1]) == len(expected) // 2
    assert sorted(per_rank[0] + per_rank[1]) == expected


@distributed(num_accelerators=2)
def read_with_torchs_loader(table: str, batch_rows: int):
    import os

    import pyarrow.compute as pc
    import torch.distributed as dist
    import torch.utils.data

    from fanrun.data import TableDataset

    dist.init_process_group("gloo")
    dataset = TableDataset(table, columns=["id"], filter=pc.field("id") >= 20, batch_rows=batch_rows)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2 if os.environ["RANK"] == "0" else 0)
    ids = [i for batch in loader for i in batch["id"].tolist()]
    dist.destroy_process_group()
    return ids


def test_torchs_own_dataloader_in_a_2_rank_run_reads_every_row_once(delta):
    per_rank = read_with_torchs_loader.distributed(delta["root"], 4)
    expected = [row["id"] for row in delta_rows(delta["root"]) if row["id"] >= 20]
    assert len(per_rank[0]) == len(per_rank[1]) == -(-len(expected) // 2)
    seen = collections.Counter(per_rank[0] + per_rank[1])
    assert sorted(seen) == expected and sum(seen.values()) - len(expected) < 2


@distributed(num_accelerators=2)
def train_until_killed(table: str, out: str, steps_before_kill: int):
    import json
    import os

    import torch.distributed as dist

    from fanrun.data import DataLoader, TableDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = TableDataset(table, columns=["id"], seed=9, batch_rows=3)
    loader = DataLoader(dataset, batch_size=None, num_workers=2 if rank == 0 else 1)
    for step, batch in enumerate(loader):
        if step == steps_before_kill and rank == 1:
            os.kill(os.getpid(), 9)
        with open(os.path.join(out, f"read-{rank}"), "a") as log:
            log.write(json.dumps(batch["id"].tolist()) + "\n")
        dist.barrier()  # every rank took this step
        if rank == 0:
            with open(os.path.join(out, "state.json"), "w") as state:
                json.dump(dataset.state_dict(), state)
        dist.barrier()  # the state is saved before anyone goes on


@distributed(num_accelerators=3)
def resume(table: str, out: str):
    import json
    import os

    from fanrun.data import DataLoader, TableDataset

    dataset = TableDataset(table, columns=["id"], seed=9, batch_rows=5)
    with open(os.path.join(out, "state.json")) as state:
        dataset.load_state_dict(json.load(state))
    loader = DataLoader(dataset, batch_size=None, num_workers=int(os.environ["RANK"]))
    return [i for batch in loader for i in batch["id"].tolist()]


def test_a_run_killed_with_sigkill_resumes_on_3_ranks_with_exactly_the_rest(delta, tmp_path):
    with pytest.raises(RankFailedError, match="Rank 1 of 2"):
        train_until_killed.distributed(delta["root"], str(tmp_path), 7)
    before = collections.Counter()
    for rank in range(2):
        lines = (tmp_path / f"read-{rank}").read_text().splitlines()
        for line in lines[:7]:  # the steps the saved state counts
            before.update(json.loads(line))
    after = collections.Counter(i for ids in resume.distributed(delta["root"], str(tmp_path)) for i in ids)
    everything = {row["id"] for row in delta_rows(delta["root"])}
    assert set(before) | set(after) == everything
    assert not set(before) & set(after)
    assert sum(before.values()) == len(before) and sum(after.values()) - len(after) < 3


# ---------------------------------------------------------------- bad input


def test_a_corrupt_parquet_footer_names_the_table_and_the_file(parquet, tmp_path):
    root = tmp_path / "table"
    shutil.copytree(parquet, root)
    victim = sorted(root.rglob("*.parquet"))[2]
    data = victim.read_bytes()
    victim.write_bytes(data[:-12] + b"\0" * 12)  # the footer's length and magic gone
    with pytest.raises(TableError, match=rf"Parquet table {root}: its file {victim} is not a readable Parquet file"):
        TableDataset(str(root))


def test_a_column_that_does_not_exist_is_named_with_those_that_do(parquet):
    with pytest.raises(TableError, match=r"has no column 'label'; its columns are id, text, tags, vec, day"):
        TableDataset(parquet, columns=["id", "label"])


def test_a_delta_log_that_names_a_missing_file_is_named(delta, tmp_path):
    root = tmp_path / "table"
    shutil.copytree(delta["root"], root)
    gone = sorted(root.glob("*.parquet"))[-1]
    gone.unlink()
    with pytest.raises(TableError, match=rf"Delta table {root}: its log names the file {gone}, which does not exist"):
        TableDataset(str(root))


def test_a_column_added_in_a_later_version_is_refused_at_an_earlier_one(delta):
    with pytest.raises(TableError, match=r"at version 1 has no column 'extra'; its columns are id, day, text"):
        TableDataset(delta["root"], version=1, columns=["id", "extra"])
    assert TableDataset(delta["root"], columns=["id", "extra"]).num_rows == ROWS - 6 + 5


def test_other_bad_input_is_refused_before_any_read(parquet, tmp_path):
    with pytest.raises(TableError, match=r"version=2 asks for a Delta table's version, and this is no Delta table"):
        TableDataset(parquet, version=2)
    with pytest.raises(TableError, match=r"table .*nowhere does not exist"):
        TableDataset(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"batch_rows must be a positive number of rows or None, not 0"):
        TableDataset(parquet, batch_rows=0)
    with pytest.raises(TypeError, match=r"filter must be a pyarrow expression"):
        TableDataset(parquet, filter="day = 1")
    dataset = TableDataset(parquet)
    state = dataset.state_dict()
    with pytest.raises(ValueError, match=r"saved for another table or order, .*\(seed: saved 0, now 1\)"):
        TableDataset(parquet, seed=1).load_state_dict(state)
