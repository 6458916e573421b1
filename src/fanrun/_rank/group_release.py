"""Process groups that the function destroyed, held until its call is over, so that none is
destroyed in a way that hangs the rank.

`destroy_process_group()` leaves a group alive while a `DistributedDataParallel` (its reducer)
still refers to it. The group is then destroyed when the model is: at the function's return, or
in a garbage collection soon after. The reducer destroys it with the GIL held (torch 2.13), and a
gloo group's destructor joins its worker threads, one of which may still be releasing the last
collective's tensors, for which it needs the GIL: the rank hangs for good, its result never
sent. Holding the Python group object keeps the reducer's reference from being the last one.
Once the result is sent, the held objects are dropped; torch destroys a group whose last
reference is its Python object with the GIL released, so that its threads end.

Run as a file by the worker, like the worker itself: standard library only; torch is never
imported here.
"""

from __future__ import annotations

import os
import runpy
import sys

_call_after_import = runpy.run_path(os.path.join(os.path.dirname(__file__), "after_import.py"))["call_after_import"]

_held: list = []  # the Python objects of the groups destroy_process_group ended in this call
_patched = False


def install() -> None:
    """Holds the groups destroy_process_group ends, once torch is imported (once per process)."""
    _call_after_import("torch", _patch_destroy)


def release() -> None:
    """Lets the groups of this call go: a kept rank's next call must not find them."""
    _held.clear()


def _patch_destroy() -> None:
    global _patched
    if _patched:
        return
    _patched = True
    distributed = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    original = getattr(c10d, "destroy_process_group", None)
    if distributed is None or original is None or not hasattr(world, "pg_map"):
        return  # a torch without distributed, or other internals: nothing is held

    def destroy_process_group(*args, **kwargs):
        groups = list(world.pg_map)
        try:
            return original(*args, **kwargs)
        finally:
            _held.extend(group for group in groups if group not in world.pg_map)

    destroy_process_group.__wrapped__ = original
    destroy_process_group.__doc__ = original.__doc__
    c10d.destroy_process_group = destroy_process_group
    if getattr(distributed, "destroy_process_group", None) is original:
        distributed.destroy_process_group = destroy_process_group
