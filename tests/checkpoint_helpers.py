"""Helpers shared by the checkpoint tests: the model they save, and DCP calls in the test
process itself (no process group) for cases where distribution is not the point."""

from __future__ import annotations

import warnings


def make_model(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _no_dist(call, *args, **kwargs):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # DCP says it assumes a single process when no group exists: exactly what is meant here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return getattr(dcp, call)(*args, no_dist=True, **kwargs)


def save_here(state_dict, writer, **options):
    return _no_dist("save", state_dict, storage_writer=writer, **options)


def load_here(state_dict, reader):
    return _no_dist("load", state_dict, storage_reader=reader)
