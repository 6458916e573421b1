"""How a call watches for stalls, as a door asks for it (the decorator's stall_timeout= and
on_stall=, `fanrun run --stall-timeout --on-stall`): one check for every door, in its own words."""

from __future__ import annotations

import math
import numbers
from typing import Any

ON_STALL = ("report", "abort")
ARGUMENTS = ("stall_timeout", "on_stall", "None")
FLAGS = ("--stall-timeout", "--on-stall", "off")


def check_stall(stall_timeout: Any, on_stall: Any, names: tuple[str, str, str] = ARGUMENTS) -> dict[str, Any]:
    """Options' stall_timeout and on_stall, or a ValueError naming the setting as the door spells it."""
    timeout_name, on_stall_name, unset = names
    if stall_timeout is not None and (isinstance(stall_timeout, bool) or not isinstance(stall_timeout, numbers.Real)
                                      or not stall_timeout > 0 or math.isinf(stall_timeout)):
        raise ValueError(f"{timeout_name} must be a positive number of seconds, or None for the automatic one (the "
                         f"larger of 60 s and 10 step times once steps are seen, 300 s before), not {stall_timeout!r}")
    if not (on_stall is None or on_stall in ON_STALL or (callable(on_stall) and not isinstance(on_stall, str))):
        raise ValueError(f"{on_stall_name} must be 'report' (say why, and go on), 'abort' (stop the call with "
                         f"fanrun.RankStalledError), a function that takes the report, or {unset} to watch for no "
                         f"stall, not {on_stall!r}")
    return {"stall_timeout": None if stall_timeout is None else float(stall_timeout), "on_stall": on_stall}
