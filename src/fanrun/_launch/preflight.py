"""What would stop a run halfway, found before anything starts."""

from __future__ import annotations

import os
import resource

from .._accelerators import Plan
from .._errors import DescriptorLimitError, WorkingDirectoryError

# Descriptors the caller holds for each rank while a run lasts: its log, stdout, stderr and
# control pipes, its keeper's pidfd and socket, and the rendezvous store's connections from it.
DESCRIPTORS_PER_RANK = 8

# Those the engine holds for a moment while it starts a rank, some of them numbered 64 and up.
DESCRIPTORS_TO_START = 16

FIRST_HIGH_DESCRIPTOR = 64


def preflight(plan: Plan) -> None:
    """What would stop a run halfway, found before anything starts: a working directory that
    was deleted (the ranks start in it, and importing torch there crashes), and a descriptor
    limit too low for this many ranks."""
    try:
        os.getcwd()
    except FileNotFoundError:
        try:
            where = os.readlink("/proc/self/cwd")
        except OSError:
            where = "unknown"
        raise WorkingDirectoryError(
            f"the working directory no longer exists ({where}): it was removed after this process entered it, "
            f"and every rank starts in it. Change to an existing directory (os.chdir or cd) and try again"
        ) from None
    _check_descriptor_limit(plan.world_size)



def _check_descriptor_limit(world_size: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    open_now = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself held
    needed = max(open_now + DESCRIPTORS_PER_RANK * world_size + DESCRIPTORS_TO_START,
                 FIRST_HIGH_DESCRIPTOR + DESCRIPTORS_TO_START)
    if needed <= soft:
        return
    suggested = max(4096, 2 * needed)
    if hard != resource.RLIM_INFINITY:
        suggested = min(suggested, hard)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if needed <= hard:
        advice = (
            f"Raise it before starting Python (`ulimit -n {suggested}` in the shell), or in Python with "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({suggested}, hard))"
        )
    else:
        advice = "That is above the hard limit: run fewer ranks, or have the hard limit raised (limits.conf)"
    raise DescriptorLimitError(
        f"a run of {world_size} rank{'s' if world_size != 1 else ''} needs about {needed} file descriptors in this "
        f"process ({open_now} are open already), but its limit of open files (RLIMIT_NOFILE) is {soft}, "
        f"hard limit {hard_text}. {advice}; `ulimit -n` shows the limit."
    )
