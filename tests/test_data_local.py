"""VolumeDataset over generated local files, in one process with real DataLoader workers:
bad input, in-place reads, the native cache, faults, resume, and runs sharing a cache."""

from __future__ import annotations

import collections
import ctypes
import gc
import mmap
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from fanrun import FanrunError
from fanrun._errors import CacheLimitError, DataFileError, DataSourceError
from fanrun.data import DataLoader, UCVolumeDataset, VolumeDataset


def make_corpus(root: Path, count: int, size: int = 64) -> list[Path]:
    paths = []
    for i in range(count):
        path = root / f"part{i % 3}" / f"sample{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        label = f"sample {i}\n".encode()
        path.write_bytes(label + b"x" * max(0, size - len(label)))
        paths.append(path)
    return paths


def label(path: str) -> str:
    with open(path, "rb") as file:
        return file.readline().decode().strip()


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "volume"
    make_corpus(root, 40)
    (root / "notes.txt").write_text("not a sample")
    return root


# ---------------------------------------------------------------- bad input


def test_missing_path_empty_directory_and_unmatched_pattern_are_named(tmp_path, corpus):
    with pytest.raises(DataSourceError, match="does not exist") as missing:
        VolumeDataset(tmp_path / "nowhere", cache_dir=tmp_path / "cache")
    assert str(tmp_path / "nowhere") in str(missing.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataSourceError, match="holds no file") as empty:
        VolumeDataset(tmp_path / "empty", cache_dir=tmp_path / "cache")
    assert str(tmp_path / "empty") in str(empty.value)
    with pytest.raises(DataSourceError, match=r"no file matching the pattern '\*\.jpg'") as unmatched:
        VolumeDataset(corpus, pattern="*.jpg", cache_dir=tmp_path / "cache")
    assert str(corpus) in str(unmatched.value)
    assert isinstance(unmatched.value, FileNotFoundError) and isinstance(unmatched.value, FanrunError)


def test_bad_options_are_refused_before_any_work(tmp_path, corpus):
    with pytest.raises(ValueError, match="not a size such as"):
        VolumeDataset(corpus, cache_dir=tmp_path / "cache", cache_limit="lots")
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        VolumeDataset(corpus, cache_dir=tmp_path / "cache", prefetch=-1)
    with pytest.raises(TypeError, match="transform must be callable"):
        VolumeDataset(corpus, cache_dir=tmp_path / "cache", transform="decode")
    ds = VolumeDataset(corpus, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="persistent_workers=True cannot be used"):
        DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=True)


def test_a_cache_limit_below_what_prefetch_needs_says_the_minimum(tmp_path, corpus):
    # 64-byte files, 2 prefetched + 1 in use + 1 kept: 4 files for the one reader.
    with pytest.raises(CacheLimitError, match=r"below the 256 bytes .* at least 256") as error:
        VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache", cache_local=True,
                      cache_limit=200, prefetch=2, transform=label)
    assert isinstance(error.value, ValueError)
    # Two workers are two readers: the workers check again and the loader re-raises it.
    ds = VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache", cache_local=True,
                       cache_limit=300, prefetch=2, transform=label)
    with pytest.raises(CacheLimitError, match="below the 512 bytes"):
        list(DataLoader(ds, batch_size=4, num_workers=2))


# ---------------------------------------------------------------- reading


def test_local_files_are_read_in_place_and_sorted_recursively(tmp_path, corpus):
    ds = UCVolumeDataset(corpus, pattern="*.bin", shuffle=False, cache_dir=tmp_path / "cache")
    assert ds.files == sorted(str(p) for p in corpus.rglob("*.bin"))
    assert list(ds) == ds.files  # the sources themselves: nothing copied
    assert not any((tmp_path / "cache").rglob("files/*"))
    ds._prefetcher.get().drain()  # every file was looked at or, cached already, skipped; none failed
    stats = ds._prefetcher.get().stats()
    assert stats["failed"] == 0 and sum(stats.values()) == 40
    assert stats["resident"] > 0  # just written: in the page cache, not read ahead again


def bytes_in_memory(path: str) -> int:
    """What a read with RWF_NOWAIT gets: it stops at the first page not in memory yet (and
    starts the kernel's readahead from there, so it is only asked once)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer, total = bytearray(1 << 20), 0
        while True:
            try:
                got = os.preadv(fd, [buffer], total, os.RWF_NOWAIT)
            except BlockingIOError:
                return total
            if got == 0:
                return total
            total += got
    finally:
        os.close(fd)


def pages_cached(path: str) -> int:
    """How many of the file's pages are in the page cache: mincore(), which reads nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = os.path.getsize(path), os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    pages = (ctypes.c_ubyte * (-(-size // page)))()
    try:
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), pages) == 0
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return sum(p & 1 for p in pages)


def drop_from_page_cache(paths: list[Path]) -> None:
    """As on a cold disk; the test is skipped where the files stay in memory (a tmpfs)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if any(pages_cached(str(p)) for p in paths):
        pytest.skip(f"{paths[0].parent} keeps its files in memory (a tmpfs?)")


def test_large_local_files_are_in_memory_when_their_reader_gets_them(tmp_path):
    size = 2 * (1 << 20)  # read through by the prefetcher, whole, before the reader starts
    paths = make_corpus(tmp_path / "large", 6, size)
    drop_from_page_cache(paths)
    ds = VolumeDataset(tmp_path / "large", cache_dir=tmp_path / "cache", transform=bytes_in_memory)
    assert list(ds) == [size] * 6
    assert ds._prefetcher.get().stats()["hinted"] == 6


def test_cached_copies_hold_the_same_bytes_and_a_second_reader_finds_them(tmp_path, corpus):
    ds = VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache", cache_local=True)
    paths = list(ds)
    assert all(p.startswith(str(tmp_path / "cache" / "files")) for p in paths)
    by_label = {label(p): Path(p).read_bytes() for p in paths}
    assert by_label == {label(str(p)): p.read_bytes() for p in corpus.rglob("*.bin")}
    assert ds._cache.get().stats()["fetched"] == 40
    again = VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache", cache_local=True)
    assert sorted(map(label, again)) == sorted(by_label)
    assert again._cache.get().stats() | {"hits": 0} == {**again._cache.get().stats(), "hits": 0}
    assert again._cache.get().stats()["hits"] == 40 and again._cache.get().stats()["fetched"] == 0


def test_the_cache_stays_within_its_limit_by_evicting_files_not_in_use(tmp_path, corpus):
    ds = VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache", cache_local=True,
                       cache_limit=640, prefetch=2, transform=label)
    assert sorted(ds) == sorted(f"sample {i}" for i in range(40))
    assert ds._cache.get().stats()["evicted"] > 0
    assert sum(p.stat().st_size for p in (tmp_path / "cache" / "files").iterdir()) <= 640


def test_a_file_that_disappears_is_retried_then_named_or_skipped_and_counted(tmp_path, corpus):
    ds = VolumeDataset(corpus, pattern="*.bin", shuffle=False, cache_dir=tmp_path / "cache", retries=1, transform=label)
    gone = Path(ds.files[5])
    gone.unlink()
    with pytest.raises(DataFileError, match="after 2 attempts") as error:
        list(ds)
    assert str(gone) in str(error.value)

    skipping = VolumeDataset(corpus, pattern="*.bin", shuffle=False, cache_dir=tmp_path / "cache", retries=1,
                             transform=label, skip_unreadable=True)
    Path(skipping.files[6]).unlink()
    with pytest.warns(UserWarning, match="skips"):
        samples = list(skipping)
    # Listed after the first file went: 39 files, one of which went after the listing.
    assert len(samples) == 38 and skipping.skipped_files == [skipping.files[6]]

    cached = VolumeDataset(corpus, pattern="*.bin", shuffle=False, cache_dir=tmp_path / "cache2", retries=2,
                           cache_local=True)
    Path(cached.files[0]).unlink()
    with pytest.raises(DataFileError, match="3 attempts") as error:
        list(cached)
    assert cached.files[0] in str(error.value)


def test_a_read_that_fails_once_is_retried(tmp_path, corpus):
    failed = set()

    def flaky(path: str) -> str:
        # A mount that answers the first read of each file with EIO.
        if path not in failed:
            failed.add(path)
            raise OSError(5, "Input/output error", path)
        return label(path)

    ds = VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache", retries=1, transform=flaky)
    assert sorted(ds) == sorted(f"sample {i}" for i in range(40))


# ---------------------------------------------------------------- resume with workers


@pytest.mark.parametrize("workers_before,workers_after", [(2, 1), (0, 2)])
def test_resume_mid_epoch_gives_exactly_the_rest_with_other_num_workers(tmp_path, corpus, workers_before, workers_after):
    ds = VolumeDataset(corpus, pattern="*.bin", seed=7, cache_dir=tmp_path / "cache", transform=label)
    ds.set_epoch(3)
    loader = DataLoader(ds, batch_size=3, num_workers=workers_before)
    consumed = []
    for step, batch in enumerate(loader):
        consumed += batch
        if step == 4:
            state = ds.state_dict()
            break
    assert state["offset"] == 15 and state["epoch"] == 3

    resumed = VolumeDataset(corpus, pattern="*.bin", seed=7, cache_dir=tmp_path / "cache", transform=label)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    rest = [s for batch in DataLoader(resumed, batch_size=3, num_workers=workers_after) for s in batch]
    assert not set(consumed) & set(rest)
    assert sorted(consumed + rest) == sorted(f"sample {i}" for i in range(40))
    # The same order the uninterrupted epoch would have had.
    whole = VolumeDataset(corpus, pattern="*.bin", seed=7, cache_dir=tmp_path / "cache", transform=label)
    whole.set_epoch(3)
    assert consumed + rest == list(whole)
    # Iterated again without set_epoch: the whole epoch 3 again, in the same order.
    assert list(resumed) == consumed + rest
    # The epoch done, the next one is whole again and in another order.
    resumed.set_epoch(4)
    fourth = list(resumed)
    assert sorted(fourth) == sorted(consumed + rest) and fourth != consumed + rest


def started_by_worker(path: str) -> tuple[int, int, str]:
    """Which worker read the file and when it started, on the clock all processes share."""
    import time

    import torch.utils.data

    started = time.monotonic_ns()
    time.sleep(0.05)  # a slow read: without turns, the workers' first batches overlap
    return torch.utils.data.get_worker_info().id, started, label(path)


def open_descriptors() -> set[int]:
    """This process's open descriptors, less the one that listed them (closed by now)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
            found.add(int(name))
        except OSError:
            pass
    return found


def first_reads_by_worker(ds: VolumeDataset) -> dict[int, list[int]]:
    """When each worker of a 3-worker loader (batches of 2) started each of its reads."""
    starts = collections.defaultdict(list)
    samples = []
    for workers, times, labels in DataLoader(ds, batch_size=2, num_workers=3):
        for worker, started in zip(workers.tolist(), times.tolist()):
            starts[worker].append(started)
        samples += labels
    assert sorted(samples) == sorted(f"sample {i}" for i in range(40))
    return starts


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores, on purpose
def test_workers_make_their_first_batches_in_turn_and_leave_no_descriptor(tmp_path, corpus):
    drop_from_page_cache(sorted(corpus.rglob("*.bin")))  # turns share a disk: here, a cold one
    ds = VolumeDataset(corpus, pattern="*.bin", shuffle=False, cache_dir=tmp_path / "cache", transform=started_by_worker)
    gc.collect()  # earlier tests' datasets, whose prefetchers hold /dev/null, must not close it during the loop
    descriptors = open_descriptors()
    starts = first_reads_by_worker(ds)
    for worker in (1, 2):
        # Its first read began after the worker before it had read its first batch's two.
        assert min(starts[worker]) > sorted(starts[worker - 1])[1]
    # torch's queues close their last pipe ends from their feeder threads, after the loop.
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":
            thread.join()
    assert open_descriptors() == descriptors


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_workers_whose_first_files_are_in_the_page_cache_start_at_once(tmp_path, corpus):
    ds = VolumeDataset(corpus, pattern="*.bin", shuffle=False, cache_dir=tmp_path / "cache", transform=started_by_worker)
    starts = first_reads_by_worker(ds)  # the corpus was just written: every file is in memory
    for worker in (1, 2):
        # Its first read began while the worker before it was still on its first batch.
        assert min(starts[worker]) < sorted(starts[worker - 1])[1]


def test_spawned_workers_read_every_sample_with_no_turns_to_inherit(tmp_path, corpus):
    ds = VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache", transform=label)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    assert sorted(s for batch in loader for s in batch) == sorted(f"sample {i}" for i in range(40))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_torchs_own_dataloader_reads_every_sample_once_over_ranks_and_workers(tmp_path, corpus, monkeypatch, workers,
                                                                                batch_size):
    """torch.utils.data.DataLoader, not fanrun's: each rank's part, split over its workers by
    get_worker_info(); fanrun.data.DataLoader adds only the exact resume."""
    import torch.utils.data

    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = VolumeDataset(corpus, pattern="*.bin", seed=4, cache_dir=tmp_path / "cache", transform=label)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
        per_rank.append([s for batch in loader for s in (batch if batch_size else [batch])])
    assert len(per_rank[0]) == len(per_rank[1]) == 20
    assert sorted(per_rank[0] + per_rank[1]) == sorted(f"sample {i}" for i in range(40))


def test_without_a_loader_a_loaded_state_resumes_one_pass(tmp_path, corpus):
    ds = VolumeDataset(corpus, pattern="*.bin", seed=2, cache_dir=tmp_path / "cache", transform=label)
    whole = list(ds)
    iterator = iter(ds)
    head = [next(iterator) for _ in range(10)]
    state = ds.state_dict()
    assert head == whole[:10] and state["offset"] == 10
    ds.load_state_dict(state)
    assert list(ds) == whole[10:]
    assert list(ds) == whole  # the resumed pass over, the next is whole


def test_a_state_for_other_files_is_refused(tmp_path, corpus):
    ds = VolumeDataset(corpus, pattern="*.bin", cache_dir=tmp_path / "cache")
    other = VolumeDataset(corpus, pattern="part1/*", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="num_files: saved 40"):
        other.load_state_dict(ds.state_dict())
    with pytest.raises(ValueError, match="Not a VolumeDataset state"):
        ds.load_state_dict({"epoch": 1})


# ---------------------------------------------------------------- processes sharing a cache

READER = textwrap.dedent(
    """
    import hashlib, signal, sys, resource
    from fanrun.data import VolumeDataset
    source, cache, limit, fsize = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if fsize:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that writing past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    ds = VolumeDataset(source, cache_dir=cache, cache_local=True, cache_limit=limit or None, prefetch=4,
                       transform=lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest())
    for epoch in range(2):
        ds.set_epoch(epoch)
        print(" ".join(sorted(ds)), flush=True)
    """
)


def run_reader(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", READER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_runs_sharing_one_cache_directory_at_once_both_read_correctly(tmp_path):
    paths = make_corpus(tmp_path / "volume", 60, size=20_000)
    import hashlib

    expected = " ".join(sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in paths))
    # A limit that forces eviction while the other run reads.
    readers = [run_reader(str(tmp_path / "volume"), str(tmp_path / "cache"), "400000", "0") for _ in range(2)]
    for reader in readers:
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        assert out.splitlines() == [expected, expected]
    assert not list((tmp_path / "cache" / "partial").iterdir())


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_corrupt(tmp_path):
    make_corpus(tmp_path / "volume", 10, size=50_000)
    reader = run_reader(str(tmp_path / "volume"), str(tmp_path / "cache"), "0", "30000")
    _, err = reader.communicate(timeout=120)
    assert reader.returncode != 0
    assert "File too large" in err and str(tmp_path / "cache") in err and "DataFileError" in err
    assert "the cache's filesystem is full: free space there" in err
    assert not list((tmp_path / "cache" / "files").iterdir())  # no half file was ever renamed in
    # With room again, a new run on the same directory just works.
    again = run_reader(str(tmp_path / "volume"), str(tmp_path / "cache"), "0", "0")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert len(out.splitlines()) == 2


def test_importing_fanrun_does_not_import_torch():
    code = "import sys, fanrun; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
