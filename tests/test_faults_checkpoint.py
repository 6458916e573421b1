"""The checkpoint fault matrix: damaged metadata and records, file names that leave the
checkpoint, item lengths that do not fit, a metadata pickle that would run code, missing remote
files, a disk that fills up while the metadata is written, failed and killed saves, and damaged
data. Each test says what fanrun promises.

Cases that could crash the interpreter run in a child process (this file, run as a script), so
that a crash fails the test instead of killing pytest. DCP reports a failure as one
CheckpointException (a BaseException) whose text holds each rank's traceback; the tests read
the error's type and message there."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from checkpoint_helpers import load_here, save_here  # noqa: E402

RECORD = "fanrun-checkpoint.json"


def small_state():
    """A checkpoint with a few dtypes and a non-tensor value: about 1 KiB of metadata."""
    import torch

    torch.manual_seed(0)
    return {
        "w": torch.randn(16, 16),
        "i": torch.arange(5, dtype=torch.int64),
        "h": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
        "step": 7,
    }


def empty_like(state):
    import torch

    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def same(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli), written out here so that the tests do not trust the engine's own."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def metadata_path(checkpoint: Path) -> Path:
    return checkpoint / json.loads((checkpoint / RECORD).read_text())["metadata"]


def rewrite_metadata(fs, checkpoint: str, change) -> None:
    """Rewrites a checkpoint's metadata as a crafted one would be: change(index, location) gives
    each item's new location, and the record is made to agree with the new bytes (its size and
    CRC32C, where the record has them), so that only the check under test can refuse it."""
    record = json.loads(fs.cat_file(f"{checkpoint}/{RECORD}"))
    metadata = pickle.loads(fs.cat_file(f"{checkpoint}/{record['metadata']}"))
    metadata.storage_data = {index: change(index, location) for index, location in metadata.storage_data.items()}
    data = pickle.dumps(metadata)
    fs.pipe_file(f"{checkpoint}/{record['metadata']}", data)
    if "metadata_crc32c" in record:
        record["metadata_size"], record["metadata_crc32c"] = len(data), crc32c(data)
        fs.pipe_file(f"{checkpoint}/{RECORD}", json.dumps(record).encode())


# ---------------------------------------------------------------- damaged metadata and records


def flip_every_byte(root: str) -> dict:
    """In a child process: saves small_state, then flips one bit at every byte position of the
    metadata and then of the record (bit = position % 8), loading the checkpoint each time.
    Returns, for each file, how many loads ended which way."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import NotACheckpointError, VolumeReader, VolumeWriter

    checkpoint = Path(root) / "ckpt"
    expected = small_state()
    save_here(expected, VolumeWriter(checkpoint))
    outcomes: dict = {}
    for kind, target in (("metadata", metadata_path(checkpoint)), ("record", checkpoint / RECORD)):
        original = target.read_bytes()
        seen = outcomes[kind] = {}
        for position in range(len(original)):
            damaged = bytearray(original)
            damaged[position] ^= 1 << (position % 8)
            target.write_bytes(damaged)
            into = empty_like(expected)
            try:
                load_here(into, VolumeReader(checkpoint))
                ending = "correct" if same(into, expected) else f"wrong at {position}"
            except NotACheckpointError:
                ending = "NotACheckpointError"
            except CheckpointException as error:
                ending = _ending(str(error), position)
            except Exception as error:  # noqa: BLE001 - every other ending is reported
                ending = f"other at {position}: {type(error).__name__}: {error}"
            seen[ending] = seen.get(ending, 0) + 1
        target.write_bytes(original)
    return outcomes


def _ending(text: str, position: int) -> str:
    """How a load failed, from a CheckpointException's text. DCP turns an error of
    read_metadata into an AssertionError that keeps the message alone."""
    if "Checksum mismatch in checkpoint file" in text and "item 'metadata'" in text:
        return "metadata checksum mismatch"
    for kind in ("CheckpointCorruptError", "NotACheckpointError"):
        if kind in text:
            return kind
    return f"other at {position}: {text[-300:]}"


def test_a_bit_flipped_anywhere_in_the_metadata_or_the_record_is_refused_or_harmless(tmp_path):
    """Every single-bit flip of the metadata is refused before it is unpickled (its CRC32C is in
    the record); every flip of the record is refused or changes nothing that is loaded. Never a
    wrong tensor, never a crash."""
    child = subprocess.run(
        [sys.executable, __file__, "flip_every_byte", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, f"the child ended with {child.returncode}: {child.stderr[-3000:]}"
    outcomes = json.loads(child.stdout.splitlines()[-1])
    assert list(outcomes["metadata"]) == ["metadata checksum mismatch"], outcomes["metadata"]
    refusals = {"NotACheckpointError", "CheckpointCorruptError", "metadata checksum mismatch"}
    assert set(outcomes["record"]) <= {"correct", *refusals}, outcomes["record"]


@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_truncated_metadata_is_skipped_by_latest_checkpoint(tmp_path, keep):
    """Metadata cut to nothing or to half: latest_checkpoint returns the older intact checkpoint,
    and opening the damaged one says what is wrong."""
    from fanrun.data import NotACheckpointError, VolumeReader, VolumeWriter, latest_checkpoint

    save_here(small_state(), VolumeWriter(tmp_path / "step_1"))
    save_here(small_state(), VolumeWriter(tmp_path / "step_2"))
    metadata = metadata_path(tmp_path / "step_2")
    os.truncate(metadata, int(metadata.stat().st_size * keep))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_1")
    with pytest.raises(NotACheckpointError, match=rf"its metadata '{metadata.name}' has \d+ bytes, \d+ were written"):
        VolumeReader(tmp_path / "step_2")


def test_metadata_damaged_without_changing_its_size_is_skipped_by_latest_checkpoint(tmp_path):
    """A same-size change of the metadata (one bit) is found by its CRC32C: latest_checkpoint
    passes over that checkpoint and the load names the file."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    save_here(small_state(), VolumeWriter(tmp_path / "step_1"))
    save_here(small_state(), VolumeWriter(tmp_path / "step_2"))
    metadata = metadata_path(tmp_path / "step_2")
    damaged = bytearray(metadata.read_bytes())
    damaged[len(damaged) // 2] ^= 0x04
    metadata.write_bytes(damaged)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_1")
    with pytest.raises(CheckpointException) as failure:
        load_here(empty_like(small_state()), VolumeReader(tmp_path / "step_2"))
    text = str(failure.value)
    assert f"Checksum mismatch in checkpoint file '{metadata}', item 'metadata'" in text, text


def test_a_record_without_a_metadata_checksum_still_loads(tmp_path):
    """Checkpoints written before records gave the metadata's CRC32C (record version 1) load as
    they always did."""
    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    save_here(small_state(), VolumeWriter(tmp_path / "old"))
    record = json.loads((tmp_path / "old" / RECORD).read_text())
    del record["metadata_size"], record["metadata_crc32c"]
    record["version"] = 1
    (tmp_path / "old" / RECORD).write_text(json.dumps(record))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "old")
    into = empty_like(small_state())
    load_here(into, VolumeReader(tmp_path / "old"))
    assert same(into, small_state())


# ---------------------------------------------------------------- item lengths and offsets


def test_an_enlarged_item_length_fails_before_any_byte_moves(tmp_path):
    """A length in the metadata larger than the tensor it is loaded into (4096 -> 4352 bytes) is
    a CheckpointCorruptError naming the item, and no byte is written: neither into the tensor
    nor into the 256 bytes after it (a guard, the tail of the buffer the tensor is cut from)."""
    import fsspec
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter

    # "v" follows "w" in the data file, so that reading past w's 4096 bytes finds bytes to copy.
    save_here({"w": torch.arange(1024, dtype=torch.float32), "v": torch.ones(1024)}, VolumeWriter(tmp_path / "ckpt"))
    rewrite_metadata(
        fsspec.filesystem("file"),
        str(tmp_path / "ckpt"),
        lambda index, loc: dataclasses.replace(loc, length=4352) if index.fqn == "w" else loc,
    )
    buffer = torch.full((1024 + 64,), -1.0)
    target = buffer[:1024]  # contiguous and of the saved shape: read in place
    with pytest.raises(CheckpointException) as failure:
        load_here({"w": target, "v": torch.zeros(1024)}, VolumeReader(tmp_path / "ckpt"))
    assert torch.equal(buffer, torch.full((1024 + 64,), -1.0)), "bytes were written into or past the tensor"
    text = str(failure.value)
    assert "CheckpointCorruptError" in text, text
    assert "gives item 'w' a length of 4352 bytes, but its shape (1024,) of float32 holds 4096" in text, text


# Damage to each field of an item's location, as a crafted metadata file (with a record made to
# agree with it) would hold it: the field and what it is set to. Item 'w' is float32 (16, 16).
DAMAGED_FIELDS = [
    ("offset", -1), ("offset", -4096), ("offset", True), ("offset", "0"), ("offset", 1.0), ("offset", None),
    ("offset", 1 << 64), ("offset", 1 << 40),
    ("length", -1), ("length", False), ("length", 1024.0), ("length", 1 << 63), ("length", 1 << 20), ("length", 1020),
    ("crc32c", -1), ("crc32c", 1 << 32), ("crc32c", None), ("crc32c", "0"),
    ("dtype", "nonsense"), ("dtype", "nn"), ("dtype", "__class__"), ("dtype", 7), ("dtype", None),
    ("shape", None), ("shape", (-16, -16)), ("shape", (16, 8)), ("shape", [16, 16]), ("shape", (16.0, 16)),
    ("shape", (True, 16 * 16)), ("shape", "16x16"),
    ("file", "r9-other.data"), ("file", 5), ("file", None), ("file", ".."),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), DAMAGED_FIELDS, ids=[f"{f}={v!r}" for f, v in DAMAGED_FIELDS])
def test_each_damaged_field_of_an_item_is_refused_naming_the_item_before_any_byte_moves(tmp_path, field, value):
    """Every field of an item's location (file, offset, length, CRC32C, dtype, shape) is checked,
    by type and by range, against the others and against the file sizes the record gives, in one
    place before anything is read: damage to any of them is a CheckpointCorruptError naming the
    item and the value, never a TypeError of the engine's arguments, and no byte is loaded."""
    import fsspec
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import CheckpointCorruptError, VolumeReader, VolumeWriter

    save_here(small_state(), VolumeWriter(tmp_path / "ckpt"))
    rewrite_metadata(
        fsspec.filesystem("file"),
        str(tmp_path / "ckpt"),
        lambda index, loc: dataclasses.replace(loc, **{field: value}) if index.fqn == "w" else loc,
    )
    into = empty_like(small_state())
    with pytest.raises(CheckpointException) as error:
        load_here(into, VolumeReader(tmp_path / "ckpt"))
    failure, _ = error.value.failures[0]
    assert isinstance(failure, CheckpointCorruptError), repr(failure)
    assert "item 'w'" in str(failure) and "nothing was read" in str(failure), str(failure)
    assert repr(value) in str(failure) or str(value) in str(failure), str(failure)
    assert all(not torch.is_tensor(v) or not v.any() for v in into.values()), "bytes were loaded"


@pytest.mark.parametrize("damage", ["not a location", "not an item's key"])
def test_an_item_entry_that_is_not_a_location_or_whose_key_names_no_item_is_refused(tmp_path, damage):
    """The entries of storage_data themselves: a location that is not one, a key with no name."""
    import fsspec
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import CheckpointCorruptError, VolumeReader, VolumeWriter

    fs, checkpoint = fsspec.filesystem("file"), str(tmp_path / "ckpt")
    save_here(small_state(), VolumeWriter(checkpoint))
    if damage == "not a location":
        rewrite_metadata(fs, checkpoint, lambda index, loc: tuple(dataclasses.astuple(loc)) if index.fqn == "w" else loc)
    else:
        record = json.loads(fs.cat_file(f"{checkpoint}/{RECORD}"))
        metadata = pickle.loads(fs.cat_file(f"{checkpoint}/{record['metadata']}"))
        metadata.storage_data = {(index.fqn if index.fqn == "w" else index): loc for index, loc in metadata.storage_data.items()}
        data = pickle.dumps(metadata)
        fs.pipe_file(f"{checkpoint}/{record['metadata']}", data)
        record["metadata_size"], record["metadata_crc32c"] = len(data), crc32c(data)
        fs.pipe_file(f"{checkpoint}/{RECORD}", json.dumps(record).encode())
    with pytest.raises(CheckpointException) as error:
        load_here(empty_like(small_state()), VolumeReader(checkpoint))
    failure, _ = error.value.failures[0]
    assert isinstance(failure, CheckpointCorruptError), repr(failure)
    assert ("item 'w' the location (" if damage == "not a location" else "whose key 'w' names no item") in str(failure)


# ---------------------------------------------------------------- names and the pickle

TRAVERSALS = ["../../outside_secret.bin", "{absolute}", "nested/r0.data", "r0\x00.data"]


@pytest.mark.parametrize("name", TRAVERSALS, ids=["dotdot", "absolute", "separator", "nul"])
@pytest.mark.parametrize("where", ["local", "file", "memory"])
def test_item_file_names_that_leave_the_checkpoint_are_refused(tmp_path, where, name):
    """A data file name in the metadata that is not a plain name inside the checkpoint (.., an
    absolute path, a separator, NUL) is a CheckpointCorruptError naming it, before anything is
    read or downloaded: nothing outside the checkpoint is read, nothing outside the staging
    directory is written."""
    import fsspec
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter

    state = {"w": torch.arange(16, dtype=torch.float32)}
    if where == "memory":
        fs, root = fsspec.filesystem("memory"), f"memory://faults-{os.getpid()}-{tmp_path.name}/a/b"
    else:
        fs, root = fsspec.filesystem("file"), str(tmp_path / "a" / "b")
    checkpoint = f"{root}/ckpt"
    location = f"file://{checkpoint}" if where == "file" else checkpoint
    save_here(state, VolumeWriter(location))
    record = json.loads(fs.cat_file(f"{checkpoint}/{RECORD}"))
    data_name = next(iter(record["files"]))
    # Where ../../ from the checkpoint leads. The secret holds the very bytes the item had, so
    # that reading it would "succeed".
    secret = f"{root.rsplit('/', 1)[0]}/outside_secret.bin"
    fs.pipe_file(secret, fs.cat_file(f"{checkpoint}/{data_name}"))
    bad = name.format(absolute=secret.removeprefix("memory://"))
    rewrite_metadata(fs, checkpoint, lambda index, loc: dataclasses.replace(loc, file=bad))
    staging = tmp_path / "staging" / "inner"
    staging.mkdir(parents=True)
    before = sorted(str(p) for p in tmp_path.rglob("*"))

    into = {"w": torch.zeros(16)}
    with pytest.raises(CheckpointException) as failure:
        load_here(into, VolumeReader(location, local_staging_dir=staging))
    text = str(failure.value)
    assert "CheckpointCorruptError" in text and repr(bad) in text, text
    assert torch.equal(into["w"], torch.zeros(16))
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    if where == "memory":
        fs.rm(root.rsplit("/", 2)[0], recursive=True)


def test_a_record_naming_a_metadata_file_outside_the_checkpoint_is_refused(tmp_path):
    """The record's own names are checked too: a metadata name with '..' makes the path not a
    checkpoint (NotACheckpointError), and latest_checkpoint passes over it."""
    from fanrun.data import NotACheckpointError, VolumeReader, VolumeWriter, latest_checkpoint

    save_here(small_state(), VolumeWriter(tmp_path / "root" / "ckpt"))
    record = json.loads((tmp_path / "root" / "ckpt" / RECORD).read_text())
    shutil.copy(tmp_path / "root" / "ckpt" / record["metadata"], tmp_path / "outside.pkl")
    record["metadata"] = "../../outside.pkl"
    (tmp_path / "root" / "ckpt" / RECORD).write_text(json.dumps(record))
    with pytest.raises(NotACheckpointError, match=r"names a file '\.\./\.\./outside\.pkl'"):
        VolumeReader(tmp_path / "root" / "ckpt")
    assert latest_checkpoint(tmp_path / "root") is None


class _RunsCode:
    """Unpickling this runs a shell command: what a hostile metadata file would hold."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_metadata_pickle_that_runs_code_is_refused_before_it_is_unpickled(tmp_path):
    """A metadata file replaced by a pickle that would run a command (padded to the same size)
    does not match the CRC32C in the record: it is refused before it is unpickled, so the
    command never runs. (A checkpoint whose record was rewritten to match is another matter:
    the metadata is a pickle, as DCP's own, and a checkpoint must be trusted.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    save_here(small_state(), VolumeWriter(tmp_path / "ckpt"))
    metadata = metadata_path(tmp_path / "ckpt")
    marker = tmp_path / "marker"
    hostile = pickle.dumps(_RunsCode(f"touch {marker}"))
    size = metadata.stat().st_size
    assert len(hostile) < size
    metadata.write_bytes(hostile + b"\0" * (size - len(hostile)))  # pickle ignores what follows
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointException) as failure:
        load_here(empty_like(small_state()), VolumeReader(tmp_path / "ckpt"))
    assert "Checksum mismatch in checkpoint file" in str(failure.value)
    assert not marker.exists(), "the metadata pickle ran its command"


# ---------------------------------------------------------------- remote files


class _Handler(SimpleHTTPRequestHandler):
    """Serves a directory; paths in the server's `broken` answer 500 instead."""

    def do_GET(self):
        if self.path in self.server.broken:
            self.send_error(500, "broken on purpose")
            return
        super().do_GET()

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def http_root(tmp_path):
    """A directory served over HTTP on 127.0.0.1 (with index pages, as fsspec lists them)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(tmp_path)))
    server.broken = set()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_port}", server.broken
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_checkpoint_over_http_loads_and_a_404_names_the_url(http_root):
    """A checkpoint served over HTTP loads (the index page gives no sizes, so those checks wait
    for the download). A data file that answers 500 keeps fsspec's error, with the URL added;
    one that answers 404 is a NotACheckpointError (a FileNotFoundError) naming its URL. Neither
    is a CheckpointCorruptError."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter

    directory, url, broken = http_root
    save_here(small_state(), VolumeWriter(directory / "ckpt"))
    into = empty_like(small_state())
    load_here(into, VolumeReader(f"{url}/ckpt", local_staging_dir=directory))
    assert same(into, small_state())

    reader = VolumeReader(f"{url}/ckpt", local_staging_dir=directory)
    data_name = next(iter(json.loads((directory / "ckpt" / RECORD).read_text())["files"]))
    broken.add(f"/ckpt/{data_name}")
    with pytest.raises(CheckpointException) as failure:
        load_here(empty_like(small_state()), reader)
    text = str(failure.value)
    assert "500" in text and f"Fetching checkpoint file '{url}/ckpt/{data_name}' failed" in text, text
    assert "CheckpointCorruptError" not in text, text

    broken.clear()
    os.unlink(directory / "ckpt" / data_name)
    with pytest.raises(CheckpointException) as failure:
        load_here(empty_like(small_state()), reader)
    text = str(failure.value)
    assert f"NotACheckpointError: Checkpoint file '{url}/ckpt/{data_name}' is not there (not found)" in text, text
    assert "CheckpointCorruptError" not in text, text
    assert not [p for p in directory.iterdir() if p.name.startswith("fanrun-download-")]


def test_a_remote_file_removed_after_opening_is_not_found_naming_the_url():
    """memory://: a data file gone between opening and loading is a NotACheckpointError naming
    its URL."""
    import fsspec
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter

    url = f"memory://faults-{os.getpid()}/removed/ckpt"
    save_here(small_state(), VolumeWriter(url))
    reader = VolumeReader(url)
    fs = fsspec.filesystem("memory")
    data_name = next(iter(json.loads(fs.cat_file(f"{url}/{RECORD}"))["files"]))
    fs.rm(f"{url}/{data_name}")
    with pytest.raises(CheckpointException) as failure:
        load_here(empty_like(small_state()), reader)
    text = str(failure.value)
    assert f"NotACheckpointError: Checkpoint file '{url}/{data_name}' is not there" in text, text
    fs.rm(f"memory://faults-{os.getpid()}", recursive=True)


def test_damaged_remote_metadata_is_refused_naming_its_url():
    """memory://: the metadata is downloaded and checked as a local one is; latest_checkpoint
    passes over the damaged checkpoint, and the load names the metadata's URL."""
    import fsspec
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    root = f"memory://faults-{os.getpid()}/damaged"
    save_here(small_state(), VolumeWriter(f"{root}/step_1"))
    save_here(small_state(), VolumeWriter(f"{root}/step_2"))
    fs = fsspec.filesystem("memory")
    metadata = f"{root}/step_2/{json.loads(fs.cat_file(f'{root}/step_2/{RECORD}'))['metadata']}"
    damaged = bytearray(fs.cat_file(metadata))
    damaged[10] ^= 0x01
    fs.pipe_file(metadata, bytes(damaged))
    assert latest_checkpoint(root) == f"{root}/step_1"
    with pytest.raises(CheckpointException) as failure:
        load_here(empty_like(small_state()), VolumeReader(f"{root}/step_2"))
    assert f"Checksum mismatch in checkpoint file '{metadata}', item 'metadata'" in str(failure.value)
    fs.rm(f"memory://faults-{os.getpid()}", recursive=True)


# ---------------------------------------------------------------- failed and killed saves


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (mounting needs root, as these tests run)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount
    # Lazily, so that it goes even if a failed test left a file open on it.
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_full_disk_while_the_metadata_is_written_names_the_file_and_leaves_nothing(small_disk):
    """The data file takes every block of the disk, so the metadata cannot be written: the error
    names the metadata file (its space is reserved before it is written), and the failed save
    removes its partial directory and its lock at once. The next save that fits succeeds."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeWriter, latest_checkpoint

    with pytest.raises(CheckpointException) as failure:
        save_here({"w": torch.zeros(65536)}, VolumeWriter(small_disk / "step"))  # 256 KiB
    text = str(failure.value)
    assert "No space left on device" in text, text
    assert f"'{small_disk}/.step.fanrun-partial-" in text and "/metadata-" in text, text
    assert os.listdir(small_disk) == []
    assert latest_checkpoint(small_disk) is None
    save_here({"w": torch.zeros(16)}, VolumeWriter(small_disk / "step"))
    assert os.listdir(small_disk) == ["step"]


def test_a_failed_save_is_cleaned_up_by_the_next_save_of_the_same_process(tmp_path):
    """A save that fails while ranks write (here the coordinator's own item) leaves its partial
    directory, locked by a writer that is still referenced. The next save in the same thread
    removes both the directory and the lock, without waiting for the garbage collector."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from fanrun.data import VolumeReader, VolumeWriter

    class FailsOnStep(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn == "step":
                raise RuntimeError("the state dict cannot be read")
            return super().resolve_data(write_item)

    failed_writer = VolumeWriter(tmp_path / "step_1")
    with pytest.raises(CheckpointException, match="the state dict cannot be read"):
        save_here(small_state(), failed_writer, planner=FailsOnStep())
    assert any(n.startswith(".step_1.fanrun-partial-") for n in os.listdir(tmp_path))

    save_here(small_state(), VolumeWriter(tmp_path / "step_1"))
    assert os.listdir(tmp_path) == ["step_1"]
    into = empty_like(small_state())
    load_here(into, VolumeReader(tmp_path / "step_1"))
    assert same(into, small_state())
    del failed_writer  # referenced until here, as a caught exception's traceback would keep it


def save_then_die_mid_save(root: str) -> None:
    """In a child process: saves step_1, then is killed by SIGKILL while it saves step_2 (its
    partial directory exists, its data is being resolved)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from fanrun.data import VolumeWriter

    class Dies(DefaultSavePlanner):
        def resolve_data(self, write_item):
            os.kill(os.getpid(), signal.SIGKILL)

    save_here(small_state(), VolumeWriter(f"{root}/step_1"))
    save_here(small_state(), VolumeWriter(f"{root}/step_2"), planner=Dies())


def test_sigkill_mid_save_leaves_the_previous_checkpoint_latest_and_the_next_save_cleans_up(tmp_path):
    """A process killed while it saves leaves the previous checkpoint latest and loadable; its
    partial directory is removed by the next save in that root."""
    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    child = subprocess.run([sys.executable, __file__, "save_then_die_mid_save", str(tmp_path)], timeout=300)
    assert child.returncode == -signal.SIGKILL
    assert any(n.startswith(".step_2.fanrun-partial-") for n in os.listdir(tmp_path))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_1")
    into = empty_like(small_state())
    load_here(into, VolumeReader(tmp_path / "step_1"))
    assert same(into, small_state())
    save_here(small_state(), VolumeWriter(tmp_path / "step_3"))
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_3"]


# ---------------------------------------------------------------- damaged data


def test_a_flipped_data_byte_names_the_file_and_the_item(tmp_path):
    """Every item has a CRC32C: one flipped bit in the data is a CheckpointCorruptError naming
    the data file and the item."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader, VolumeWriter

    save_here(small_state(), VolumeWriter(tmp_path / "ckpt"))
    metadata = pickle.loads(metadata_path(tmp_path / "ckpt").read_bytes())
    location = next(loc for index, loc in metadata.storage_data.items() if index.fqn == "w")
    data = tmp_path / "ckpt" / location.file
    with open(data, "r+b") as f:
        f.seek(location.offset + 100)
        byte = f.read(1)[0]
        f.seek(location.offset + 100)
        f.write(bytes([byte ^ 0x20]))
    with pytest.raises(CheckpointException) as failure:
        load_here(empty_like(small_state()), VolumeReader(tmp_path / "ckpt"))
    text = str(failure.value)
    assert "CheckpointCorruptError: Checksum mismatch" in text and f"'{data}', item 'w'" in text, text


def test_a_truncated_data_file_is_skipped_by_latest_checkpoint_and_refused(tmp_path):
    """A data file that lost its end: latest_checkpoint passes over the checkpoint, and opening
    it says which file is short."""
    from fanrun.data import NotACheckpointError, VolumeReader, VolumeWriter, latest_checkpoint

    save_here(small_state(), VolumeWriter(tmp_path / "step_1"))
    save_here(small_state(), VolumeWriter(tmp_path / "step_2"))
    data_name = next(iter(json.loads((tmp_path / "step_2" / RECORD).read_text())["files"]))
    os.truncate(tmp_path / "step_2" / data_name, 10)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_1")
    with pytest.raises(NotACheckpointError, match=f"its file '{data_name}' has 10 bytes"):
        VolumeReader(tmp_path / "step_2")


if __name__ == "__main__":
    scenario, root = sys.argv[1], sys.argv[2]
    if scenario == "flip_every_byte":
        print(json.dumps(flip_every_byte(root)))
    elif scenario == "save_then_die_mid_save":
        save_then_die_mid_save(root)
