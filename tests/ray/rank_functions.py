"""Functions for ranks that must not import mlflow before they run: the test module imports it,
and a function pickled by reference imports its module in the rank. Each pretends that node 1 is
another machine, with its own disk where the caller keeps something."""

from __future__ import annotations

import fanrun


def on_two_nodes(**options):
    return fanrun.distributed(num_accelerators=4, nodes=2, accelerator_type="CPU", **options)


def view_of_another_machine(folder: str) -> None:
    """In a rank: `folder` as a machine with its own disk there would see it, empty (a mount
    namespace of the rank's own, and a tmpfs over the folder). Needs root."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000
    assert libc.unshare(CLONE_NEWNS) == 0, os.strerror(ctypes.get_errno())
    assert libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    assert libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, None) == 0, os.strerror(ctypes.get_errno())


@on_two_nodes()
def save_where_node_1_sees_other_files(root):
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fanrun.data import VolumeWriter

    if os.environ["NODE_RANK"] == "1":
        view_of_another_machine(root)
    dist.init_process_group("gloo")
    try:
        dcp.save({"weight": torch.ones(4) * dist.get_rank()}, storage_writer=VolumeWriter(f"{root}/step_1"))
        return None
    except BaseException as error:  # DCP's CheckpointException derives from BaseException
        return str(error)


@on_two_nodes()
def log_where_node_1_cannot_see_the_store(store_folder):
    import os

    if os.environ["NODE_RANK"] == "1":
        view_of_another_machine(store_folder)
    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(3):
        mlflow.log_metric(f"steps/rank_{rank}", rank * 10 + step, step=step)
    mlflow.log_param(f"param_{rank}", rank)
    return mlflow.active_run().info.run_id
