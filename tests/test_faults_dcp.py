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
    FileSystemWriter; returns each refusal as {rank: (type, is RuntimeError, message)}."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import CheckpointExistsError, VolumeWriter

    dist.init_process_group("gloo")
    state = {"w": torch.arange(10.0) + dist.get_rank()}
    out = {}
    for name, writer in (("fanrun", VolumeWriter), ("dcp", FileSystemWriter)):
        dcp.save(state, storage_writer=writer(f"{root}/{name}"))
        try:
            dcp.save(state, storage_writer=writer(f"{root}/{name}", overwrite=False))
            out[name] = None
        except CheckpointException as error:
            out[name] = {
                rank: (type(exc).__name__, isinstance(exc, RuntimeError), isinstance(exc, CheckpointExistsError), str(exc))
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
        for name, is_runtime_error, is_exists_error, message in out["fanrun"].values():
            assert name == "CheckpointExistsError" and is_runtime_error and is_exists_error
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
