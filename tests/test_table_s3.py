"""TableDataset over the S3 protocol, from a real S3 server process on 127.0.0.1: a partitioned
Delta table with a deletion vector and several versions, its log read by delta-rs and its files
by pyarrow, both given the one storage_options dict (endpoint, credentials); the files come
through the node's file cache, which tells two stores with the same bucket and key apart."""

from __future__ import annotations

import os

import pytest
from delta_tables import delete_rows, live_files
from s3_server import S3Server

pa = pytest.importorskip("pyarrow")
pc = pytest.importorskip("pyarrow.compute")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("deltalake")
pytest.importorskip("boto3")

from fanrun import distributed  # noqa: E402
from fanrun.data import TableDataset, TableError  # noqa: E402

ROWS = 120
DELETED = [0, 2, 5, 7]


def rows(first: int, n: int) -> pa.Table:
    ids = range(first, first + n)
    return pa.table({"id": pa.array(ids, pa.int64()), "day": [f"2026-11-{28 + i % 3}" for i in ids],
                     "text": [f"row {i}" for i in ids]})


def server_gone(server: S3Server) -> bool:
    try:
        os.killpg(server.process.pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """s3://lake/events: version 0, 90 rows over 3 day partitions; 1, 30 more; 2, a deletion
    vector over one file. Uploaded whole, log and all, after it was written on disk."""
    from deltalake import write_deltalake
    from deltalake.writer import WriterProperties

    local = tmp_path_factory.mktemp("lake") / "events"
    groups = WriterProperties(max_row_group_size=8)
    write_deltalake(str(local), rows(0, 90), partition_by=["day"], writer_properties=groups,
                    configuration={"delta.enableDeletionVectors": "true"})
    write_deltalake(str(local), rows(90, 30), partition_by=["day"], mode="append", writer_properties=groups)
    first = sorted(live_files(str(local)), key=lambda add: add["path"])[0]
    delete_rows(str(local), first, DELETED)
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        keys = server.upload(local, "lake", "events")
        yield {"server": server, "local": str(local), "keys": keys, "uri": "s3://lake/events"}
    finally:
        server.stop()
    assert server_gone(server)


def delta_rows(uri: str, options: dict | None = None, version: int | None = None) -> list[dict]:
    from deltalake import DeltaTable

    scan = DeltaTable(uri, version=version, storage_options=options).scan()
    return sorted(pa.RecordBatchReader.from_stream(scan).read_all().to_pylist(), key=lambda row: row["id"])


def fetched(dataset: TableDataset) -> dict:
    return dataset.source.remote._cache.get().stats()


def test_a_delta_table_on_s3_reads_its_versions_and_deletion_vector_through_the_cache(store, tmp_path):
    options = store["server"].storage_options()
    latest = TableDataset(store["uri"], storage_options=options, cache_dir=tmp_path, shuffle=False)
    assert latest.num_rows == ROWS - len(DELETED)
    got = sorted(latest, key=lambda row: row["id"])
    assert got == delta_rows(store["local"]) == delta_rows(store["uri"], options)
    files = {f.source for f in latest.source.files}
    assert all(source.startswith("s3://lake/events/day=") for source in files)
    assert fetched(latest)["fetched"] == len(files)
    assert fetched(latest)["bytes_fetched"] == sum(os.path.getsize(os.path.join(store["local"], *f.path.split("/")[2:]))
                                                   for f in latest.source.files)
    before_delete = TableDataset(store["uri"], version=1, storage_options=options, cache_dir=tmp_path)
    assert before_delete.num_rows == ROWS
    assert sorted(row["id"] for row in before_delete) == list(range(ROWS))
    assert fetched(before_delete)["fetched"] == 0  # version 1's files are version 2's: found in the cache


def test_a_partition_filter_fetches_only_the_files_it_keeps(store, tmp_path):
    dataset = TableDataset(store["uri"], storage_options=store["server"].storage_options(), cache_dir=tmp_path,
                           filter=pc.field("day") == "2026-11-29", columns=["id"])
    assert sorted(row["id"] for row in dataset) == [i for i in range(ROWS) if i % 3 == 1]
    assert fetched(dataset)["fetched"] == len(dataset.source.files) == 2  # the partition's file of each version


def read_ids(uri: str, options: dict, cache_dir: str) -> list[int]:
    from fanrun.data import DataLoader, TableDataset

    dataset = TableDataset(uri, columns=["id"], storage_options=options, cache_dir=cache_dir, seed=3)
    return [int(i) for batch in DataLoader(dataset, batch_size=4, num_workers=2) for i in batch["id"]]


def test_two_ranks_with_workers_read_every_row_once_and_share_the_nodes_cache(store, tmp_path):
    reader = distributed(num_accelerators=2, tracking=False)(read_ids)
    first, second = reader.distributed(store["uri"], store["server"].storage_options(), str(tmp_path))
    live = [row["id"] for row in delta_rows(store["local"])]
    assert sorted(first + second) == sorted(live) and len(first) == len(second)
    # The ranks' workers left every file in the node's cache: a later reader fetches none.
    again = TableDataset(store["uri"], storage_options=store["server"].storage_options(), cache_dir=tmp_path)
    list(again)
    assert fetched(again)["fetched"] == 0


def test_the_cache_tells_two_stores_with_the_same_bucket_and_key_apart(store, tmp_path, tmp_path_factory):
    other = S3Server(tmp_path_factory.mktemp("s3-other"))
    try:
        written = tmp_path / "written"
        (written / "table").mkdir(parents=True)
        pq.write_table(pa.table({"id": pa.array([-1, -2], pa.int64())}), written / "table" / "part-0.parquet")
        pq.write_table(pa.table({"id": pa.array([-4, -3], pa.int64())}), written / "part-1.parquet")
        other.upload(written / "table", "lake", "other")
        cache = tmp_path / "cache"
        assert (written / "table" / "part-0.parquet").stat().st_size == (written / "part-1.parquet").stat().st_size
        first = TableDataset("s3://lake/other/part-0.parquet", storage_options=other.storage_options(), cache_dir=cache)
        assert sorted(row["id"] for row in first) == [-2, -1]
        # The same bucket and key on the first store, another object of the same size.
        store["server"].client().upload_file(str(written / "part-1.parquet"), "lake", "other/part-0.parquet")
        second = TableDataset("s3://lake/other/part-0.parquet", storage_options=store["server"].storage_options(),
                              cache_dir=cache)
        assert sorted(row["id"] for row in second) == [-4, -3]  # the first store's object, not the other's cached one
        assert fetched(second)["fetched"] == 1
    finally:
        other.stop()
    assert server_gone(other)


def test_storage_options_the_reader_cannot_take_are_named(store, tmp_path):
    options = store["server"].storage_options()
    with pytest.raises(TableError, match=r"storage_options has 'AWS_PROXY_URL', which the S3 reader does not take"):
        TableDataset(store["uri"], storage_options={**options, "AWS_PROXY_URL": "http://proxy"}, cache_dir=tmp_path)
    no_http = {k: v for k, v in options.items() if k != "AWS_ALLOW_HTTP"}
    with pytest.raises(TableError, match=r"plain-http endpoint .* without AWS_ALLOW_HTTP='true'"):
        TableDataset(store["uri"], storage_options=no_http, cache_dir=tmp_path)


def test_a_file_gone_from_the_store_is_named(store, tmp_path):
    server = store["server"]
    client = server.client()
    client.create_bucket(Bucket="gone")
    for key in store["keys"]:
        client.copy_object(Bucket="gone", Key=key, CopySource={"Bucket": "lake", "Key": key})
    dataset = TableDataset("s3://gone/events", storage_options=server.storage_options(), cache_dir=tmp_path,
                           shuffle=False, columns=["id"])
    victim = dataset.source.files[0]
    client.delete_object(Bucket="gone", Key=victim.path.split("/", 1)[1])
    with pytest.raises(TableError, match=rf"Delta table s3://gone/events: .*{victim.source}"):
        list(dataset)
