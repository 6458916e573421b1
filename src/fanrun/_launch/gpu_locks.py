"""One lock per GPU, held while a call of this user runs on it, so that two calls never share a
GPU unawares: a call that finds its GPUs busy says which call holds them and waits for them (a
detached run waits QUEUED). The locks are flock()s on files in the runs root's private locks/
folder, named by each GPU's UUID, so they end with their holder, however it ends."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Callable, Iterator

from .._accelerators import Gpu
from .._errors import UnsafePathError
from .._private_dir import open_private, open_private_subdir
from .._spec.paths import open_runs_root

_REMEDY = "Remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a directory of your own."
# What NVML's UUIDs look like ("GPU-" and hex digits in dashed groups), a little wider: the lock's
# file name is made of it, so it must be one plain name inside locks/, never '..' or a path.
_GPU_UUID = re.compile(r"GPU-[0-9A-Za-z-]{1,128}")


@contextlib.contextmanager
def hold(gpus: tuple[Gpu, ...], holder: str, on_busy: Callable[[str], None]) -> Iterator[None]:
    """Holds the locks of `gpus` for the block. Where one is busy, `on_busy` is told which call
    holds it, then the wait goes on until it is free (an interrupt ends the wait)."""
    if not gpus:
        yield
        return
    # Every name is checked before locks/ is opened, so that a bad one leaves nothing behind.
    names = {gpu: lock_file_name(gpu) for gpu in gpus}
    held: list[int] = []
    locks_fd = _locks_dir()
    try:
        for gpu in sorted(gpus, key=lambda gpu: gpu.uuid):  # one order for everyone: no deadlock
            fd = open_private(locks_fd, names[gpu], os.O_RDWR | os.O_CREAT)
            held.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = os.pread(fd, 1024, 0).decode(errors="replace").strip() or "another call"
                on_busy(f"GPU {gpu.nvml_index} ({gpu.name}) is in use by {other}; waiting until it is free")
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder} (pid {os.getpid()})".encode(), 0)
        yield
    finally:
        for fd in held:
            os.close(fd)  # and with it the lock
        os.close(locks_fd)


def lock_file_name(gpu: Gpu) -> str:
    """The name of a GPU's lock file in locks/, made of its UUID once the UUID is known to be one."""
    if not isinstance(gpu.uuid, str) or not _GPU_UUID.fullmatch(gpu.uuid):
        raise UnsafePathError(
            f"GPU {gpu.nvml_index} ({gpu.name}) has the UUID {gpu.uuid!r}, which is not a GPU UUID ('GPU-' "
            "followed by letters, digits and dashes); fanrun names the GPU's lock file after it, so it locks "
            "nothing with this one. Check the GPUs the driver lists (nvidia-smi -L)"
        )
    return f"{gpu.uuid}.lock"


def _locks_dir() -> int:
    root, root_fd = open_runs_root()
    try:
        return open_private_subdir(root_fd, "locks", str(root), what="fanrun's GPU locks", remedy=_REMEDY)
    finally:
        os.close(root_fd)
