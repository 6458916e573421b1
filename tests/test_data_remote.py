"""VolumeDataset over HTTP from a real nginx on 127.0.0.1, through fsspec's HTTP filesystem:
files fetched into the node's cache by the native threads, verified (size; MD5 where a store
lists one), found again warm, and a file that vanishes from the server named after its retries."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from nginx_server import NginxServer

from fanrun import _core
from fanrun._errors import DataFileError, EngineOSError
from fanrun.data import VolumeDataset
from fanrun.data._cache import FsspecFetch
from fanrun.data._dataset_source import listed_md5

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
    stats = ds._cache.get().stats()
    assert stats["fetched"] == 30 and stats["bytes_fetched"] == sum(map(len, contents.values()))
    assert not list((tmp_path / "cache" / "partial").iterdir())

    warm = VolumeDataset(server.url + "/", pattern="shard*/*.bin", cache_dir=tmp_path / "cache", transform=first_line)
    assert dict(warm) == contents
    assert warm._cache.get().stats()["hits"] == 30 and warm._cache.get().stats()["fetched"] == 0


def test_listing_leaves_no_client_session_for_a_forked_worker_to_close(served, tmp_path):
    """fsspec closes an HTTP filesystem's session from a finalizer, through its event-loop
    thread. Run in a DataLoader worker forked from the lister, which has no such thread,
    that finalizer waited 1 s before the worker's first batch."""
    import gc
    import weakref

    def session_closers() -> list:
        return [f for f in gc.get_objects() if type(f) is weakref.finalize and f.alive
                and getattr(f.peek()[1], "__name__", "") == "close_session"]

    server = served[0]
    before = len(session_closers())
    for options in ({}, {"client_kwargs": {}}):  # the engine's client, then fsspec's
        ds = VolumeDataset(server.url + "/", pattern="shard*/*.bin", cache_dir=tmp_path / "cache", storage_options=options)
        assert len(ds.files) == 30
        assert len(session_closers()) == before


def test_a_small_cache_limit_evicts_and_still_serves_every_file(served, tmp_path):
    server, _, contents = served
    ds = VolumeDataset(server.url + "/shard0/", cache_dir=tmp_path / "cache", cache_limit="200KB", prefetch=2,
                       transform=first_line)
    assert dict(ds) == {k: v for i, (k, v) in enumerate(sorted(contents.items(), key=lambda kv: int(kv[0][5:]))) if i % 2 == 0}
    assert ds._cache.get().stats()["evicted"] > 0
    assert sum(p.stat().st_size for p in (tmp_path / "cache" / "files").iterdir()) <= 200_000


@contextlib.contextmanager
def removed(path: Path) -> Iterator[None]:
    """The file is gone from the server while the block runs, and back afterwards."""
    data = path.read_bytes()
    path.unlink()
    try:
        yield
    finally:
        path.write_bytes(data)


def test_a_file_gone_from_the_server_is_retried_then_named(served, tmp_path):
    server, root, _ = served
    victim = root / "shard1" / "item029.bin"
    ds = VolumeDataset(server.url + "/shard1/", cache_dir=tmp_path / "cache", retries=2, transform=first_line)
    with removed(victim), pytest.raises(DataFileError, match="3 attempts") as error:
        list(ds)
    assert f"{server.url}/shard1/item029.bin" in str(error.value)
    assert "HTTP 404 Not Found" in str(error.value)  # nginx's answer, as the engine's HTTP client reports it

    # With storage options (headers, here), fsspec fetches, as the options are its to apply.
    through_fsspec = VolumeDataset(server.url + "/shard1/", cache_dir=tmp_path / "cache-fsspec", retries=0,
                                   transform=first_line, storage_options={"headers": {"X-Fanrun-Test": "1"}})
    with removed(victim), pytest.raises(DataFileError, match="1 attempts") as error:
        list(through_fsspec)
    assert "FileNotFoundError" in str(error.value)  # nginx's 404, as fsspec reports it

    skipping = VolumeDataset(server.url + "/shard1/", cache_dir=tmp_path / "cache", retries=0,
                             skip_unreadable=True, transform=first_line)
    with removed(victim), pytest.warns(UserWarning, match="item029.bin"):
        samples = list(skipping)
    assert len(samples) == 14 and skipping.skipped_files == [f"{server.url}/shard1/item029.bin"]


def test_bytes_that_do_not_have_the_listed_md5_are_never_moved_into_the_cache(served, tmp_path):
    # The engine and fsspec as a dataset uses them; the MD5 is given here, as S3's or GCS's
    # listing would give it (nginx lists none).
    server, root, _ = served
    url = f"{server.url}/shard0/item000.bin"
    right = hashlib.md5((root / "shard0" / "item000.bin").read_bytes()).hexdigest()
    wrong = _core.FileCache(str(tmp_path / "cache"), 0, 2, 2, FsspecFetch({}, {url: "0" * 32}))
    with pytest.raises(EngineOSError, match=f"MD5 {right} of the bytes fetched from '{url}' is not the 0{{32}}") as error:
        wrong.acquire(url, "item000.bin", -1)
    assert "2 attempts" in str(error.value)
    assert not list((tmp_path / "cache" / "files").iterdir()) and not list((tmp_path / "cache" / "partial").iterdir())
    wrong.close()
    checked = _core.FileCache(str(tmp_path / "cache"), 0, 2, 2, FsspecFetch({}, {url: right}))
    path = checked.acquire(url, "item000.bin", -1)
    assert hashlib.md5(Path(path).read_bytes()).hexdigest() == right
    checked.close()


def test_only_whole_file_md5s_of_s3_and_gcs_listings_are_taken_as_checksums():
    digest = hashlib.md5(b"data").digest()
    # The shapes of gcsfs's and s3fs's info() entries.
    assert listed_md5({"md5Hash": base64.b64encode(digest).decode()}, ("gs", "gcs")) == digest.hex()
    assert listed_md5({"ETag": f'"{digest.hex()}"'}, ("s3", "s3a")) == digest.hex()
    assert listed_md5({"ETag": '"9b2cf535f27731c974343645a3985328-2"'}, ("s3", "s3a")) is None  # multipart
    assert listed_md5({"ETag": f'"{digest.hex()}"'}, ("http", "https")) is None  # not a checksum there


def test_a_full_cache_disk_under_a_remote_fetch_is_a_clear_error(served, tmp_path):
    server, _, _ = served
    code = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writing past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        from fanrun.data import VolumeDataset
        list(VolumeDataset({server.url + "/shard0/"!r}, cache_dir={str(tmp_path / "cache")!r}, retries=0))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "DataFileError" in done.stderr and "File too large" in done.stderr, done.stderr
    assert "the cache's filesystem is full: free space there" in done.stderr
    assert not list((tmp_path / "cache" / "files").iterdir())
