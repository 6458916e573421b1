"""VolumeWriter / VolumeReader held to what DCP's own FileSystemWriter / FileSystemReader do:
tensors whose values are a view's flags (conjugate, negative), every dtype DCP saves, the
overwrite=False refusal on every rank, and DCP's own format both ways (checkpoints that
FileSystemWriter wrote load through VolumeReader; export_dcp writes one that DCP's tools read).

Cases without a process group run DCP in this process; the distributed ones run 2 CPU ranks
with gloo, each comparing fanrun's plug-ins with DCP's own on the same state."""

from __future__ import annotations

import os
import warnings

import pytest

from checkpoint_helpers import load_here, make_model, save_here
from fanrun import distributed

# Every dtype DCP saves and loads (torch.float8_* where this torch has them).
DTYPE_NAMES = [
    "bfloat16", "float16", "float32", "float64", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]  # fmt: skip


def async_save_here(state_dict, writer):
    """dcp.async_save without a process group, waited for."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.async_save(state_dict, storage_writer=writer, no_dist=True).result()


SAVES = {"save": save_here, "async_save": async_save_here}


def every_bit_pattern(dtype, generator):
    """A 5x7 tensor of random bytes viewed as dtype (NaNs, infinities and subnormals included)."""
    import torch

    if dtype == torch.bool:
        return torch.randint(0, 2, (5, 7), generator=generator).bool()
    raw = torch.randint(0, 256, (5 * 7 * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(5, 7)


def same_bytes(a, b) -> bool:
    """Bit-for-bit equality, which torch.equal is not for NaNs."""
    import torch

    a, b = a.resolve_conj().resolve_neg().contiguous(), b.resolve_conj().resolve_neg().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ------------------------------------------------------------ conjugate and negative views


@pytest.mark.parametrize("save", SAVES)
def test_a_conjugate_view_is_saved_as_its_values(tmp_path, save):
    """A conj view (its bit set, its memory the base's) is saved as conj(z), not z."""
    import torch

    from fanrun.data import VolumeReader, VolumeWriter

    z = torch.randn(6, 5, dtype=torch.complex64)
    state = {"c": z.conj(), "c_t": z.t().conj(), "c128": z.to(torch.complex128).conj()}
    SAVES[save](state, VolumeWriter(tmp_path / "ckpt"))
    loaded = {key: torch.zeros_like(value.resolve_conj()) for key, value in state.items()}
    load_here(loaded, VolumeReader(tmp_path / "ckpt"))
    for key, value in state.items():
        assert torch.equal(loaded[key], value.resolve_conj()), key


@pytest.mark.parametrize("save", SAVES)
def test_a_negative_view_is_saved_as_its_values(tmp_path, save):
    """torch._neg_view(x) (a flag over x's memory) is saved as -x, not x."""
    import torch

    from fanrun.data import VolumeReader, VolumeWriter

    x = torch.randn(4, 3)
    z = torch.randn(4, 3, dtype=torch.complex64)
    # A neg view of a conj view carries both flags.
    state = {"n": torch._neg_view(x), "nc": torch._neg_view(z.conj())}
    SAVES[save](state, VolumeWriter(tmp_path / "ckpt"))
    loaded = {"n": torch.zeros(4, 3), "nc": torch.zeros(4, 3, dtype=torch.complex64)}
    load_here(loaded, VolumeReader(tmp_path / "ckpt"))
    assert torch.equal(loaded["n"], -x)
    assert torch.equal(loaded["nc"], -z.conj().resolve_conj())


def test_loading_into_a_conjugate_or_negative_view_gives_the_view_the_saved_values(tmp_path):
    """A destination that is a conj or neg view reads the saved values through its flag, as
    DCP's own reader does (read into a plain buffer, then copy_), never conj(z) or -x."""
    import torch

    from fanrun.data import VolumeReader, VolumeWriter

    z = torch.randn(6, 5, dtype=torch.complex64)
    x = torch.randn(4, 3)
    save_here({"c": z, "n": x}, VolumeWriter(tmp_path / "ckpt"))
    conj_base, neg_base = torch.zeros(6, 5, dtype=torch.complex64), torch.zeros(4, 3)
    targets = {"c": conj_base.conj(), "n": torch._neg_view(neg_base)}
    load_here(targets, VolumeReader(tmp_path / "ckpt"))
    assert torch.equal(targets["c"].resolve_conj(), z)
    assert torch.equal(targets["n"].resolve_neg(), x)
    # The bases behind the views hold what makes the views read the saved values.
    assert torch.equal(conj_base, z.conj().resolve_conj())
    assert torch.equal(neg_base, -x)


@pytest.mark.parametrize("save", SAVES)
def test_every_dtype_dcp_supports_round_trips_bit_for_bit(tmp_path, save):
    """The 17 dtypes DCP saves (bfloat16 to float8), random bit patterns, come back exactly."""
    import torch

    from fanrun.data import VolumeReader, VolumeWriter

    generator = torch.Generator().manual_seed(17)
    names = [name for name in DTYPE_NAMES if hasattr(torch, name)]
    state = {name: every_bit_pattern(getattr(torch, name), generator) for name in names}
    SAVES[save](state, VolumeWriter(tmp_path / "ckpt"))
    loaded = {name: torch.zeros_like(value) for name, value in state.items()}
    load_here(loaded, VolumeReader(tmp_path / "ckpt"))
    assert [name for name in names if not same_bytes(loaded[name], state[name])] == []


# ------------------------------------------------------------ overwrite=False

DCP_OVERWRITE_TEXT = "Checkpoint already exists and self.overwrite=False."


@distributed(num_accelerators=2)
def save_twice_without_overwrite(root: str):
    """Saves to a path, then again with overwrite=False, through VolumeWriter and through DCP's
    FileSystemWriter; returns each refusal as {rank: (type name, is a RuntimeError, message)}."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeWriter

    dist.init_process_group("gloo")
    state = {"w": torch.arange(10.0)}
    out = {}
    for name, writer in (("fanrun", VolumeWriter), ("dcp", FileSystemWriter)):
        dcp.save(state, storage_writer=writer(f"{root}/{name}"))
        try:
            dcp.save(state, storage_writer=writer(f"{root}/{name}", overwrite=False))
            out[name] = None
        except CheckpointException as error:
            out[name] = {
                rank: (type(exc).__name__, isinstance(exc, RuntimeError), str(exc))
                for rank, (exc, _) in error.failures.items()
            }
    dist.destroy_process_group()
    return out


def test_overwrite_false_is_refused_on_every_rank_with_dcps_words(tmp_path):
    """overwrite=False on an existing checkpoint fails on every rank, as DCP's writer does, with
    a CheckpointExistsError that is a RuntimeError and whose message holds DCP's text."""
    results = save_twice_without_overwrite.distributed(str(tmp_path))
    for out in results:
        assert sorted(out["dcp"]) == [0, 1]  # what DCP does, for comparison
        assert all(DCP_OVERWRITE_TEXT in message for *_, message in out["dcp"].values())
        assert sorted(out["fanrun"]) == [0, 1], out["fanrun"]
        for name, is_runtime_error, message in out["fanrun"].values():
            assert name == "CheckpointExistsError" and is_runtime_error
            assert DCP_OVERWRITE_TEXT in message and str(tmp_path / "fanrun") in message, message


def test_checkpoint_exists_error_is_a_runtime_error_and_a_file_exists_error(tmp_path):
    """Code written for DCP catches the refusal as RuntimeError; fanrun's own code as
    FileExistsError or CheckpointExistsError. The checkpoint there is left as it was."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import CheckpointExistsError, VolumeWriter

    state = {"model": make_model(seed=1).state_dict()}
    save_here(state, VolumeWriter(tmp_path / "ckpt"))
    before = sorted(os.listdir(tmp_path / "ckpt"))
    with pytest.raises(CheckpointException) as error:
        save_here(state, VolumeWriter(tmp_path / "ckpt", overwrite=False))
    refusal, _ = error.value.failures[0]
    assert isinstance(refusal, CheckpointExistsError)
    assert isinstance(refusal, RuntimeError) and isinstance(refusal, FileExistsError)
    assert str(refusal).startswith(DCP_OVERWRITE_TEXT)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and sorted(os.listdir(tmp_path / "ckpt")) == before


# ------------------------------------------------------------ DCP's format, read by VolumeReader


def mixed_state(seed: int):
    """What a training state holds: a model, every dtype, a conj view, a pickled object, bytes
    (a BytesIO, as DCP's Stateful examples save), nested dicts and lists."""
    import io

    import torch

    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(4, 3, dtype=torch.complex64, generator=generator)
    return {
        "model": make_model(seed).state_dict(),
        "dtypes": {
            name: every_bit_pattern(getattr(torch, name), generator) for name in DTYPE_NAMES if hasattr(torch, name)
        },
        "conj": z.conj(),
        "step": seed,
        "note": {"text": f"seed {seed}", "losses": [0.5, 0.25]},
        "blob": io.BytesIO(b"opaque bytes %d" % seed),
        "listed": [torch.arange(5) * seed, torch.full((2, 2), float(seed))],
    }


def empty_like_state(state):
    """A destination for mixed_state: tensors of the same shapes and dtypes, other values blank."""
    import io

    import torch

    def blank(value):
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value.resolve_conj())
        if isinstance(value, dict):
            return {key: blank(v) for key, v in value.items()}
        if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
            return [blank(v) for v in value]
        if isinstance(value, io.BytesIO):
            return io.BytesIO()
        return None

    return blank(state)


def assert_same_state(loaded, expected, where=""):
    import io

    import torch

    if isinstance(expected, torch.Tensor):
        assert same_bytes(loaded, expected), where
    elif isinstance(expected, dict):
        assert sorted(loaded) == sorted(expected), where
        for key in expected:
            assert_same_state(loaded[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(loaded) == len(expected), where
        for i, (a, b) in enumerate(zip(loaded, expected)):
            assert_same_state(a, b, f"{where}[{i}]")
    elif isinstance(expected, io.BytesIO):
        loaded.seek(0)
        assert loaded.read() == expected.getvalue(), where
    else:
        assert loaded == expected, where


WRITER_OPTIONS = {
    "default": {},
    "three_files": {"thread_count": 3},
    "a_file_per_item": {"single_file_per_rank": False},
}


@pytest.mark.parametrize("options", WRITER_OPTIONS)
def test_a_checkpoint_dcps_writer_wrote_loads_through_volume_reader(tmp_path, options):
    """A checkpoint FileSystemWriter wrote (one file, several, or one per item) loads through
    VolumeReader with the values DCP's own FileSystemReader gives: the migration path."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from fanrun.data import VolumeReader

    state = mixed_state(seed=3)
    save_here(state, FileSystemWriter(tmp_path / "dcp", **WRITER_OPTIONS[options]))
    by_dcp = empty_like_state(state)
    load_here(by_dcp, FileSystemReader(tmp_path / "dcp"))
    assert_same_state(by_dcp, state)
    by_fanrun = empty_like_state(state)
    load_here(by_fanrun, VolumeReader(tmp_path / "dcp"))
    assert_same_state(by_fanrun, state)


def test_a_dcp_checkpoint_is_found_by_checkpoint_id_and_read_partially(tmp_path):
    """dcp.load(checkpoint_id=...) with a VolumeReader given for another path reads the DCP
    checkpoint named; a state dict asking for some keys only gets them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from fanrun.data import VolumeReader, VolumeWriter

    state = mixed_state(seed=4)
    save_here(state, FileSystemWriter(tmp_path / "dcp"))
    save_here({"other": torch.zeros(1)}, VolumeWriter(tmp_path / "fanrun"))
    assert VolumeReader.validate_checkpoint_id(tmp_path / "dcp")
    partial = {"model": empty_like_state(state)["model"]}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            partial,
            checkpoint_id=tmp_path / "dcp",
            storage_reader=VolumeReader(tmp_path / "fanrun"),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    assert_same_state(partial["model"], state["model"])


def test_a_compressed_dcp_checkpoint_is_decompressed_as_dcp_does(tmp_path):
    """FileSystemWriter's ZStandard extension records a transform per item; VolumeReader undoes
    it with DCP's extension registry."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    from fanrun.data import VolumeReader

    state = mixed_state(seed=5)
    save_here(state, FileSystemWriter(tmp_path / "dcp", _extensions=[ZStandard()]))
    loaded = empty_like_state(state)
    load_here(loaded, VolumeReader(tmp_path / "dcp"))
    assert_same_state(loaded, state)


def test_a_dcp_checkpoint_at_an_fsspec_url_loads(tmp_path):
    """What DCP's FsspecWriter wrote under a URL is read by ranges through fsspec."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from fanrun.data import VolumeReader

    state = mixed_state(seed=6)
    url = f"file://{tmp_path}/dcp"
    save_here(state, FsspecWriter(url))
    loaded = empty_like_state(state)
    load_here(loaded, VolumeReader(url))
    assert_same_state(loaded, state)


def rewrite_dcp_metadata(path, change):
    import pickle

    metadata = pickle.loads((path / ".metadata").read_bytes())
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def test_dcp_file_names_stay_inside_the_checkpoint(tmp_path):
    """A .metadata whose storage_data names a file outside the checkpoint, or a data file that
    is a symlink or a FIFO, is refused before a byte of it is read."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeReader

    secret = tmp_path / "outside_secret.bin"
    secret.write_bytes(b"not for the checkpoint" * 100)
    save_here({"w": torch.arange(8.0)}, FileSystemWriter(tmp_path / "escape"))

    def point_outside(metadata):
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = dataclasses.replace(info, relative_path="../outside_secret.bin")

    rewrite_dcp_metadata(tmp_path / "escape", point_outside)
    with pytest.raises(CheckpointException, match="not a file inside the checkpoint"):
        load_here({"w": torch.zeros(8)}, VolumeReader(tmp_path / "escape"))

    save_here({"w": torch.arange(8.0)}, FileSystemWriter(tmp_path / "linked"))
    (data,) = (tmp_path / "linked").glob("*.distcp")
    data.unlink()
    data.symlink_to(secret)
    with pytest.raises(CheckpointException, match="Too many levels of symbolic links"):
        load_here({"w": torch.zeros(8)}, VolumeReader(tmp_path / "linked"))
    # A FIFO in a data file's place would block a plain open for ever.
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(CheckpointException, match="is not a regular file"):
        load_here({"w": torch.zeros(8)}, VolumeReader(tmp_path / "linked"))


DAMAGED_DCP_FIELDS = [
    ("offset", -1), ("offset", True), ("offset", "0"), ("offset", None), ("offset", 1 << 64),
    ("length", -1), ("length", 1.5), ("length", None), ("length", 1 << 63),
    ("relative_path", None), ("relative_path", ".."), ("relative_path", "a\\b\x00"),
    ("transform_descriptors", "stream.zstd/1"), ("transform_descriptors", [7]),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), DAMAGED_DCP_FIELDS, ids=[f"{f}={v!r}" for f, v in DAMAGED_DCP_FIELDS])
def test_each_damaged_field_of_a_dcp_item_is_refused_naming_the_item(tmp_path, field, value):
    """A .metadata whose storage_data gives an item a negative, huge or non-integer offset or
    length, a file name that is not one, or transforms that are not names, is refused with a
    CheckpointCorruptError naming the item before a byte of data is read."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import CheckpointCorruptError, VolumeReader

    save_here({"w": torch.arange(8.0), "v": torch.ones(4)}, FileSystemWriter(tmp_path / "dcp"))

    def damage(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == "w":
                metadata.storage_data[index] = dataclasses.replace(info, **{field: value})

    rewrite_dcp_metadata(tmp_path / "dcp", damage)
    into = {"w": torch.zeros(8), "v": torch.zeros(4)}
    with pytest.raises(CheckpointException) as error:
        load_here(into, VolumeReader(tmp_path / "dcp"))
    failure, _ = error.value.failures[0]
    assert isinstance(failure, CheckpointCorruptError), repr(failure)
    assert "item 'w'" in str(failure) and (repr(value) in str(failure) or str(value) in str(failure)), str(failure)
    assert not into["w"].any() and not into["v"].any()


def test_a_short_dcp_data_file_names_the_file_and_the_item(tmp_path):
    """A .distcp file cut short fails the load with CheckpointCorruptError naming the file and
    the item, not with whatever torch.load makes of the bytes left."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import CheckpointCorruptError, VolumeReader

    save_here({"w": torch.arange(1000.0)}, FileSystemWriter(tmp_path / "dcp"))
    (data,) = (tmp_path / "dcp").glob("*.distcp")
    os.truncate(data, data.stat().st_size - 100)
    with pytest.raises(CheckpointException) as error:
        load_here({"w": torch.zeros(1000)}, VolumeReader(tmp_path / "dcp"))
    failure, _ = error.value.failures[0]
    assert isinstance(failure, CheckpointCorruptError)
    assert str(data) in str(failure) and "item 'w'" in str(failure)


def test_latest_checkpoint_passes_over_dcp_checkpoints_and_never_removes_them(tmp_path):
    """latest_checkpoint returns fanrun checkpoints only (a DCP directory has no record of being
    complete), and keep_last never removes a directory fanrun did not write."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter

    from fanrun.data import VolumeWriter, latest_checkpoint

    save_here({"w": torch.zeros(3)}, FileSystemWriter(tmp_path / "step_1"))
    assert latest_checkpoint(tmp_path) is None
    save_here({"w": torch.ones(3)}, VolumeWriter(tmp_path / "step_2", keep_last=1))
    save_here({"w": torch.ones(3)}, VolumeWriter(tmp_path / "step_3", keep_last=1))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_3")
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_3"]


# ------------------------------------------------------------ DCP's format on two ranks, resharded


def sharded_values():
    """The whole tensors the two ranks shard: odd sizes, so that rows and columns split unevenly."""
    import torch

    generator = torch.Generator().manual_seed(19)
    return {
        "w": torch.randn(9, 7, generator=generator),
        "h": torch.randn(5, 11, dtype=torch.float64, generator=generator).to(torch.bfloat16),
        "replicated": torch.arange(12, dtype=torch.int32),
    }


@distributed(num_accelerators=2)
def save_sharded_and_load_resharded(root: str):
    """Saves DTensors sharded by rows on 2 ranks, with DCP's FileSystemWriter and with
    VolumeWriter; loads DCP's checkpoint through VolumeReader sharded by columns, by rows and
    replicated. Returns the whole tensors each load gave this rank."""
    import io

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fanrun.data import VolumeReader, VolumeWriter

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    values = sharded_values()

    def state(placement, fill=None):
        def value(key):
            return values[key] if fill is None else torch.full_like(values[key], fill)

        return {
            "w": distribute_tensor(value("w"), mesh, [placement]),
            "h": distribute_tensor(value("h"), mesh, [placement]),
            "replicated": value("replicated"),
            "step": 7 if fill is None else 0,
            "blob": io.BytesIO(b"rank-independent bytes" if fill is None else b""),
        }

    dcp.save(state(Shard(0)), storage_writer=FileSystemWriter(f"{root}/dcp"))
    dcp.save(state(Shard(0)), storage_writer=VolumeWriter(f"{root}/fanrun"))
    out = {}
    for name, placement in (("columns", Shard(1)), ("rows", Shard(0)), ("replicated", Replicate())):
        loaded = state(placement, fill=-1)
        dcp.load(loaded, storage_reader=VolumeReader(f"{root}/dcp"))
        loaded["blob"].seek(0)
        out[name] = {
            "w": loaded["w"].full_tensor(),
            "h": loaded["h"].full_tensor(),
            "replicated": loaded["replicated"],
            "step": loaded["step"],
            "blob": loaded["blob"].read(),
        }
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-ranks")
    return root, save_sharded_and_load_resharded.distributed(str(root))


def test_a_checkpoint_dcp_wrote_on_two_ranks_loads_resharded(two_rank_checkpoints):
    """Saved by FileSystemWriter on 2 ranks, sharded by rows: VolumeReader loads it on 2 ranks
    sharded by columns, by rows and replicated, and in one process whole (2 ranks to 1)."""
    import io

    import torch

    from fanrun.data import VolumeReader

    root, results = two_rank_checkpoints
    values = sharded_values()
    assert sorted(p.name for p in (root / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for out in results:
        for name, loaded in out.items():
            for key in ("w", "h", "replicated"):
                assert same_bytes(loaded[key], values[key]), (name, key)
            assert loaded["step"] == 7 and loaded["blob"] == b"rank-independent bytes", name
    whole = {key: torch.zeros_like(value) for key, value in values.items()}
    whole.update(step=0, blob=io.BytesIO())
    load_here(whole, VolumeReader(root / "dcp"))
    for key in ("w", "h", "replicated"):
        assert same_bytes(whole[key], values[key]), key
    assert whole["step"] == 7 and whole["blob"].getvalue() == b"rank-independent bytes"


# ------------------------------------------------------------ export_dcp: fanrun's checkpoints in DCP's format


def dcp_to_torch_save_here(src, dst):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_to_torch_save(src, dst)


def dcp_load_by_id(state, checkpoint_id):
    """dcp.load with nothing but a checkpoint_id: DCP picks its own FileSystemReader."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=checkpoint_id, no_dist=True)


def test_an_exported_checkpoint_is_read_by_dcps_own_tools(tmp_path):
    """export_dcp writes what FileSystemWriter writes (.metadata and __0_0.distcp, no process
    group needed): dcp_to_torch_save and dcp.load(checkpoint_id=...) give back the saved state."""
    import torch

    from fanrun.data import VolumeWriter, export_dcp

    state = mixed_state(seed=8)
    save_here(state, VolumeWriter(tmp_path / "fanrun"))
    assert export_dcp(tmp_path / "fanrun", tmp_path / "dcp") == str(tmp_path / "dcp")
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]

    dcp_to_torch_save_here(tmp_path / "dcp", tmp_path / "whole.pt")
    assert_same_state(torch.load(tmp_path / "whole.pt", weights_only=False), state)
    loaded = empty_like_state(state)
    dcp_load_by_id(loaded, tmp_path / "dcp")
    assert_same_state(loaded, state)
    # The source is untouched and still loads through VolumeReader; nothing else was left.
    assert sorted(os.listdir(tmp_path)) == ["dcp", "fanrun", "whole.pt"]


def test_an_exported_two_rank_checkpoint_keeps_its_shards(two_rank_checkpoints, tmp_path):
    """A checkpoint VolumeWriter saved on 2 ranks becomes one DCP file per rank, and DCP's
    reader assembles the shards in one process."""
    import io

    import torch

    from fanrun.data import export_dcp

    root, _ = two_rank_checkpoints
    export_dcp(root / "fanrun", tmp_path / "dcp")
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    values = sharded_values()
    whole = {key: torch.zeros_like(value) for key, value in values.items()}
    whole.update(step=0, blob=io.BytesIO())
    dcp_load_by_id(whole, tmp_path / "dcp")
    for key in ("w", "h", "replicated"):
        assert same_bytes(whole[key], values[key]), key
    assert whole["step"] == 7 and whole["blob"].getvalue() == b"rank-independent bytes"
    dcp_to_torch_save_here(tmp_path / "dcp", tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert all(same_bytes(saved[key], values[key]) for key in ("w", "h", "replicated"))


def test_export_never_replaces_a_destination_and_leaves_nothing_when_it_fails(tmp_path):
    """A destination that holds anything is refused before any work; an empty directory is
    used. A damaged source fails the export with CheckpointCorruptError, and neither the
    destination nor a partial directory is left."""
    import json
    import pickle

    import torch

    from fanrun.data import CheckpointCorruptError, CheckpointExistsError, VolumeWriter, export_dcp
    from fanrun.data.checkpoint.layout import RECORD_NAME

    save_here({"w": torch.arange(4096.0)}, VolumeWriter(tmp_path / "fanrun"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointExistsError, match="not an empty directory"):
        export_dcp(tmp_path / "fanrun", tmp_path / "taken")
    assert os.listdir(tmp_path / "taken") == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    export_dcp(tmp_path / "fanrun", tmp_path / "empty")
    assert sorted(os.listdir(tmp_path / "empty")) == [".metadata", "__0_0.distcp"]

    record = json.loads((tmp_path / "fanrun" / RECORD_NAME).read_text())
    metadata = pickle.loads((tmp_path / "fanrun" / record["metadata"]).read_bytes())
    (location,) = metadata.storage_data.values()
    with open(tmp_path / "fanrun" / location.file, "r+b") as f:
        f.seek(location.offset + 100)
        byte = f.read(1)
        f.seek(location.offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError, match="item 'w'"):
        export_dcp(tmp_path / "fanrun", tmp_path / "damaged")
    assert sorted(os.listdir(tmp_path)) == ["empty", "fanrun", "taken"]


def test_a_checkpoint_at_an_fsspec_url_exports_to_a_local_directory(tmp_path):
    """export_dcp reads its source wherever VolumeReader does (here memory://) and writes DCP's
    format to a local directory; a URL as the destination is refused."""
    from fanrun.data import VolumeWriter, export_dcp

    state = mixed_state(seed=9)
    save_here(state, VolumeWriter("memory://fanrun-export-test/step_1"))
    export_dcp("memory://fanrun-export-test/step_1", tmp_path / "dcp")
    loaded = empty_like_state(state)
    dcp_load_by_id(loaded, tmp_path / "dcp")
    assert_same_state(loaded, state)
    with pytest.raises(ValueError, match="local or mounted directory"):
        export_dcp(tmp_path / "dcp", "memory://fanrun-export-test/out")
