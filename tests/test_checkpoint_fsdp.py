"""FSDP2 (fully_shard, DTensor state dicts) on CPU ranks: saved on 4 ranks, with dcp.save and
dcp.async_save through VolumeWriter, and loaded on 2 ranks (resharded) through VolumeReader."""

from __future__ import annotations

import pytest


def sharded_model(seed: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # Odd sizes, so that the shards of 4 and of 2 ranks cut the rows at different places.
    model = torch.nn.Sequential(torch.nn.Linear(30, 70), torch.nn.ReLU(), torch.nn.Linear(70, 9))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_weights(model):
    return {key: value.full_tensor() for key, value in model.state_dict().items()}


def save_on_four(root: str):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fanrun.data import VolumeWriter

    dist.init_process_group("gloo")
    model = sharded_model(seed=0)
    dcp.save({"model": model.state_dict()}, storage_writer=VolumeWriter(f"{root}/sync"))
    expected = full_weights(model)
    future = dcp.async_save({"model": model.state_dict()}, storage_writer=VolumeWriter(f"{root}/async"))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # after the call returns: must not reach the checkpoint
    future.result()
    dist.destroy_process_group()
    return expected


def load_on_two(root: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fanrun.data import VolumeReader

    dist.init_process_group("gloo")
    loaded = {}
    for name in ("sync", "async"):
        model = sharded_model(seed=1)
        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=VolumeReader(f"{root}/{name}"))
        model.load_state_dict(state["model"])
        loaded[name] = full_weights(model)
    dist.destroy_process_group()
    return loaded


def test_fsdp_save_on_four_ranks_loads_resharded_on_two(tmp_path):
    import torch

    from fanrun import distributed

    # CPU processes on any machine: 4 ranks even where fewer GPUs are attached.
    expected = distributed(num_accelerators=4, accelerator_type="CPU")(save_on_four).distributed(str(tmp_path))
    loaded = distributed(num_accelerators=2, accelerator_type="CPU")(load_on_two).distributed(str(tmp_path))
    reference = expected[0]
    assert any(value.abs().sum() > 0 for value in reference.values())
    for rank_result in loaded:
        for name in ("sync", "async"):
            assert rank_result[name].keys() == reference.keys()
            for key in reference:
                assert torch.equal(rank_result[name][key], reference[key]), (name, key)
    # Each of the 4 saving ranks wrote its own shard file.
    record = __import__("json").loads((tmp_path / "sync" / "fanrun-checkpoint.json").read_text())
    assert len(record["files"]) == 4


pytestmark = pytest.mark.slow
