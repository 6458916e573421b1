"""Whether a GPU call is checked before it starts (the decorator's health= and exclude_unhealthy=,
`fanrun run --health --exclude-unhealthy`): one check for every door, in its own words."""

from __future__ import annotations

from typing import Any

# "cheap": NVML's answers, a few milliseconds; "deep": and a few seconds of work on every GPU;
# "off": no check.
HEALTH_LEVELS = ("cheap", "deep", "off")
DEFAULT_HEALTH = "cheap"

# What a door calls the two settings: Python's arguments, or flags.
ARGUMENTS = ("health", "exclude_unhealthy")
FLAGS = ("--health", "--exclude-unhealthy")


def check_health(health: Any, exclude_unhealthy: Any, names: tuple[str, str] = ARGUMENTS) -> dict[str, Any]:
    """Options' health and exclude_unhealthy, or an error naming the setting as the door spells it."""
    health_name, exclude_name = names
    level = "off" if health is None else health
    if not isinstance(level, str) or level not in HEALTH_LEVELS:
        raise ValueError(f"{health_name} must be 'cheap' (NVML's answers, the default), 'deep' (and a few seconds of "
                         f"work on every GPU) or 'off' (None), not {health!r}")
    if not isinstance(exclude_unhealthy, bool):
        raise TypeError(f"{exclude_name} must be True or False, not {type(exclude_unhealthy).__name__} "
                        f"({exclude_unhealthy!r})")
    if exclude_unhealthy and level == "off":
        raise ValueError(f"{exclude_name} runs the call on the GPUs the health check finds healthy, and "
                         f"{health_name}='off' checks none: drop one of them")
    return {"health": level, "exclude_unhealthy": exclude_unhealthy}
