"""fanrun.warmup() and fanrun.cooldown(): spare ranks started ahead of the calls of a notebook or
a script (backends/local/spares.py), so that even the first call finds its ranks' imports done."""

from __future__ import annotations

from collections.abc import Iterable

from . import _accelerators
from .backends.local.spares import POOL, drop_all_kept
from .backends.local import KEEPER
from .backends.rank_env import RANK_DEFAULTS
from ._tracking.caller import tracking_by_default

WAIT_LIMIT_S = 600.0


def warmup(num_accelerators: int | None = None, *, preload: Iterable[str] = (), wait: bool = False) -> bool:
    """Starts as many spare ranks as a call of ``@distributed(num_accelerators)`` runs on this
    machine (every GPU, or CPU processes where there is none), and makes every call of this
    process warm unless its decorator says ``warm=False``. Each spare imports torch and the
    other heavy libraries this process has imported, and the modules named in ``preload``,
    then waits for a call. Returns at once, the imports going on in the spares; or, with
    ``wait=True``, once they are done (at most 10 minutes). Returns whether they are."""
    names = [preload] if isinstance(preload, str) else list(preload)
    for name in names:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"preload names modules to import, like 'transformers'; {name!r} is not one")
    if num_accelerators is not None and (isinstance(num_accelerators, bool) or not isinstance(num_accelerators, int)
                                         or num_accelerators < 1):
        raise ValueError(f"num_accelerators must be a positive int or None, not {num_accelerators!r}")
    plan = _accelerators.plan_run(num_accelerators, None, _accelerators.detect())
    POOL.preload = tuple(names)
    POOL.mlflow = tracking_by_default()
    POOL.warmed_up = True
    POOL.fill(plan.world_size, KEEPER, RANK_DEFAULTS)
    return POOL.wait_ready(WAIT_LIMIT_S if wait else 0.0)


def cooldown() -> None:
    """Ends every spare rank now, and the ranks that ``keep_alive=True`` kept; calls then follow
    their default again (their decorator's ``warm``, FANRUN_WARM, the machine's cores)."""
    POOL.warmed_up = False
    POOL.drop()
    drop_all_kept()
