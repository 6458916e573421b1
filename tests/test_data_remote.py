"""VolumeDataset over HTTP from a real nginx on 127.0.0.1, through fsspec's HTTP filesystem:
files fetched into the node's cache by the native threads, verified, found again warm, and
a file that vanishes from the server named after its retries."""

from __future__ import annotations

from pathlib import Path

import pytest
from nginx_server import NginxServer

from fanrun._errors import DataFileError
from fanrun.data import VolumeDataset

pytest.importorskip("aiohttp")


def make_files(root: Path, count: int, size: int) -> dict[str, bytes]:
    contents = {}
    for i in range(count):
        path = root / f"shard{i % 2}" / f"item{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = f"item {i}\n".encode() + bytes([i % 251]) * size
        path.write_bytes(data)
        contents[f"item {i}"] = data
    return contents


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    contents = make_files(root, 30, 30_000)
    server = NginxServer(root, tmp_path_factory.mktemp("nginx"))
    yield server, root, contents
    server.stop()


def first_line(path: str) -> tuple[str, bytes]:
    with open(path, "rb") as file:
        data = file.read()
    return data.split(b"\n", 1)[0].decode(), data


def test_remote_files_are_fetched_once_into_the_cache_and_found_warm(served, tmp_path):
    server, _, contents = served
    ds = VolumeDataset(server.url + "/", pattern="shard*/*.bin", cache_dir=tmp_path / "cache", transform=first_line)
    assert ds.files == sorted(f"{server.url}/shard{i % 2}/item{i:03d}.bin" for i in range(30))
    assert dict(ds) == contents
    stats = ds._cache.stats()
    assert stats["fetched"] == 30 and stats["bytes_fetched"] == sum(map(len, contents.values()))
    assert not list((tmp_path / "cache" / "partial").iterdir())

    warm = VolumeDataset(server.url + "/", pattern="shard*/*.bin", cache_dir=tmp_path / "cache", transform=first_line)
    assert dict(warm) == contents
    assert warm._cache.stats()["hits"] == 30 and warm._cache.stats()["fetched"] == 0


def test_a_small_cache_limit_evicts_and_still_serves_every_file(served, tmp_path):
    server, _, contents = served
    ds = VolumeDataset(server.url + "/shard0/", cache_dir=tmp_path / "cache", cache_limit="200KB", prefetch=2,
                       transform=first_line)
    assert dict(ds) == {k: v for i, (k, v) in enumerate(sorted(contents.items(), key=lambda kv: int(kv[0][5:]))) if i % 2 == 0}
    assert ds._cache.stats()["evicted"] > 0
    assert sum(p.stat().st_size for p in (tmp_path / "cache" / "files").iterdir()) <= 200_000


def test_a_file_gone_from_the_server_is_retried_then_named(served, tmp_path):
    server, root, _ = served
    victim = root / "shard1" / "item029.bin"
    data = victim.read_bytes()
    ds = VolumeDataset(server.url + "/shard1/", cache_dir=tmp_path / "cache", retries=2, transform=first_line)
    victim.unlink()
    try:
        with pytest.raises(DataFileError, match="3 attempts") as error:
            list(ds)
    finally:
        victim.write_bytes(data)
    assert f"{server.url}/shard1/item029.bin" in str(error.value)
    assert "FileNotFoundError" in str(error.value)  # nginx's 404, as fsspec reports it

    skipping = VolumeDataset(server.url + "/shard1/", cache_dir=tmp_path / "cache", retries=0,
                             skip_unreadable=True, transform=first_line)
    victim.unlink()
    try:
        with pytest.warns(UserWarning, match="item029.bin"):
            samples = list(skipping)
    finally:
        victim.write_bytes(data)
    assert len(samples) == 14 and skipping.skipped_files == [f"{server.url}/shard1/item029.bin"]
