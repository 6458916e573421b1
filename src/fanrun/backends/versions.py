"""The versions that must be the same on every node as in the caller: a payload pickled by one
Python, cloudpickle or torch and loaded by another fails in ways that name neither (the most
common trouble of Ray users with several machines)."""

from __future__ import annotations

import importlib.metadata
import sys

# Distributions whose exact versions must match; Python's must match to the minor version.
CHECKED = ("fanrun", "torch", "cloudpickle")


def installed_versions() -> dict[str, str | None]:
    """Python's major.minor, and each checked distribution's version (None where not installed)."""
    found: dict[str, str | None] = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for name in CHECKED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def differences(caller: dict[str, str | None], node: dict[str, str | None]) -> list[str]:
    """'torch 2.10.0 (the caller has 2.11.0)' for each version that differs."""
    return [
        f"{name} {node.get(name) or 'not installed'} (the caller has {caller[name] or 'none'})"
        for name in caller
        if node.get(name) != caller[name]
    ]
