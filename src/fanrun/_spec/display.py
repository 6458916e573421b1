"""How a call's ranks' output shows, as a door asks for it (the decorator's display= and
stall_warning=, `fanrun run --display --stall-warning`): one check for every door, in its own words."""

from __future__ import annotations

import math
import numbers
from typing import Any

from .spec import DISPLAYS

# What a door calls the two settings, and its word for "not given": Python's arguments, or flags.
ARGUMENTS = ("display", "stall_warning", "None")
FLAGS = ("--display", "--stall-warning", "none")


def check_display(display: Any, stall_warning: Any, names: tuple[str, str, str] = ARGUMENTS) -> dict[str, Any]:
    """Options' display and stall_warning, or a ValueError naming the setting as the door spells it."""
    display_name, stall_name, unset = names
    if display is not None and display not in DISPLAYS:
        raise ValueError(f"{display_name} must be 'panel', 'logs', 'quiet' or {unset} (the panel in a notebook, logs "
                         f"elsewhere), not {display!r}")
    if stall_warning is not None and (isinstance(stall_warning, bool) or not isinstance(stall_warning, numbers.Real)
                                      or not stall_warning > 0 or math.isinf(stall_warning)):
        raise ValueError(f"{stall_name} must be a positive number of seconds, or {unset} to never flag a quiet rank, "
                         f"not {stall_warning!r}")
    return {"display": display, "stall_warning": None if stall_warning is None else float(stall_warning)}
