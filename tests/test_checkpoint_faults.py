"""Checkpoint faults: a rank SIGKILLed mid-save, a disk that fills up (RLIMIT_FSIZE) in one
rank, a flipped byte, a model of another shape. The previous checkpoint must stay loadable
and latest_checkpoint must keep returning it; errors must name what is wrong.

DCP reports every rank's failure as one CheckpointException (a BaseException) whose text holds
each rank's traceback, so the tests read the messages there."""

from __future__ import annotations

import os
import pickle
import signal

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint_helpers import load_here, make_model, save_here
from fanrun import RankFailedError, distributed


def big_state(seed: int):
    import torch

    torch.manual_seed(seed)
    return {"weight": torch.randn(256, 256), "bias": torch.randn(256), "step": seed}


@distributed(num_accelerators=2)
def save_then_die_mid_save(root: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from fanrun.data import VolumeWriter

    class DiesInRank1(DefaultSavePlanner):
        """Kills rank 1 when it resolves its first item: the coordinator has already created the
        partial directory, and rank 0 is writing or waiting."""

        def resolve_data(self, write_item):
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().resolve_data(write_item)

    dist.init_process_group("gloo")
    dcp.save(big_state(1), storage_writer=VolumeWriter(f"{root}/step_1"))
    dcp.save(big_state(2), storage_writer=VolumeWriter(f"{root}/step_2"), planner=DiesInRank1())


@distributed(num_accelerators=2)
def fill_the_disk_then_save_again(root: str):
    import gc
    import resource

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fanrun.data import VolumeWriter, latest_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"leftovers_before": sorted(n for n in os.listdir(root) if n.startswith("."))}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        # A full disk, for this rank alone: writes past 512 bytes fail with EFBIG instead of a
        # signal. (DCP gives each replicated item to one rank: this one writes at least "bias", 1 KiB.)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard))
    try:
        dcp.save(big_state(3), storage_writer=VolumeWriter(f"{root}/step_3"))
        out["error"] = None
    except BaseException as error:  # DCP's CheckpointException derives from BaseException
        out["error"] = str(error)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["latest_after_full"] = latest_checkpoint(root)
    gc.collect()  # the failed writer lets go of its partial directory when it is collected
    dist.barrier()
    dcp.save(big_state(4), storage_writer=VolumeWriter(f"{root}/step_4"))
    out["after"] = sorted(os.listdir(root))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def crashed_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    with pytest.raises(RankFailedError) as failure:
        save_then_die_mid_save.distributed(str(root))
    return root, failure.value


def test_sigkill_mid_save_leaves_the_previous_checkpoint_latest_and_loadable(crashed_root):
    import torch

    from fanrun.data import VolumeReader, latest_checkpoint

    root, failure = crashed_root
    assert failure.rank == 1 and failure.signal_name == "SIGKILL"
    names = os.listdir(root)
    assert "step_2" not in names
    assert any(".step_2.fanrun-partial-" in n for n in names), names  # the crashed save's leftovers
    assert latest_checkpoint(root) == str(root / "step_1")
    state = {"weight": torch.zeros(256, 256), "bias": torch.zeros(256), "step": 0}
    load_here(state, VolumeReader(latest_checkpoint(root)))
    expected = big_state(1)
    assert torch.equal(state["weight"], expected["weight"]) and state["step"] == 1


def test_full_disk_is_a_clear_error_and_the_next_save_cleans_up(crashed_root):
    root, _ = crashed_root
    results = fill_the_disk_then_save_again.distributed(str(root))
    for out in results:
        assert any(".step_2.fanrun-partial-" in n for n in out["leftovers_before"])
        assert out["error"] is not None and "File too large" in out["error"], out["error"]
        assert "r1-" in out["error"]  # the file that could not be written
        assert out["latest_after_full"] == str(root / "step_1")
    # The kill's and the full disk's partial directories are gone; the new checkpoint is there.
    assert results[0]["after"] == ["step_1", "step_4"]


def test_flipped_byte_names_the_file_and_the_item(tmp_path):
    import torch

    from fanrun.data import CheckpointCorruptError, VolumeReader, VolumeWriter
    from fanrun.data.checkpoint.layout import RECORD_NAME

    save_here(big_state(7), VolumeWriter(tmp_path / "ckpt"))
    record = __import__("json").loads((tmp_path / "ckpt" / RECORD_NAME).read_text())
    metadata = pickle.loads((tmp_path / "ckpt" / record["metadata"]).read_bytes())
    location = next(loc for index, loc in metadata.storage_data.items() if index.fqn == "weight")
    path = tmp_path / "ckpt" / location.file
    with open(path, "r+b") as f:
        f.seek(location.offset + 1000)
        byte = f.read(1)
        f.seek(location.offset + 1000)
        f.write(bytes([byte[0] ^ 0x01]))
    state = {"weight": torch.zeros(256, 256), "bias": torch.zeros(256), "step": 0}
    with pytest.raises(CheckpointException) as error:
        load_here(state, VolumeReader(tmp_path / "ckpt"))
    text = str(error.value)
    assert "Checksum mismatch" in text and str(path) in text and "item 'weight'" in text, text
    assert CheckpointCorruptError.__name__ in text


def test_loading_into_another_shape_is_dcps_error_naming_the_key(tmp_path):
    import torch

    from fanrun.data import VolumeReader, VolumeWriter

    save_here({"model": make_model(seed=1).state_dict()}, VolumeWriter(tmp_path / "ckpt"))
    other = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    with pytest.raises(CheckpointException, match=r"model\.2\.weight") as error:
        load_here({"model": other.state_dict()}, VolumeReader(tmp_path / "ckpt"))
    assert "Size mismatch" in str(error.value) or "size" in str(error.value).lower()


def test_a_path_that_is_not_a_checkpoint_is_refused_at_once(tmp_path):
    from fanrun.data import NotACheckpointError, VolumeReader

    with pytest.raises(NotACheckpointError, match="no fanrun-checkpoint.json"):
        VolumeReader(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "fanrun-checkpoint.json").write_text("{not json")
    with pytest.raises(NotACheckpointError, match="not valid JSON"):
        VolumeReader(tmp_path / "half")
