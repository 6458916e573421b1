"""NVML's health answers, read through the engine (fanrun._core.GpuHealthReader) with NVML opened
once per process: a gate before every call then costs a few queries, not a driver start."""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_readers: dict[str, tuple[object | None, str]] = {}


def nvml_library() -> str:
    """The NVML library to load: the driver's, unless FANRUN_NVML_LIBRARY names another."""
    return os.environ.get("FANRUN_NVML_LIBRARY", "libnvidia-ml.so.1")


def read(nvml_indices: list[int]) -> tuple[list[dict | None], str]:
    """One reading per index (None for a GPU the driver no longer reports), and "" or why NVML could
    not be read at all (then every reading is None)."""
    from .. import _core

    library = nvml_library()
    with _lock:
        if library not in _readers:
            _readers[library] = _core.GpuHealthReader.open(library)
        reader, why = _readers[library]
    if reader is None:
        return [None] * len(nvml_indices), why
    present = [index for index in nvml_indices if 0 <= index < reader.count]
    readings = {reading["nvml_index"]: reading for reading in reader.read(present)}
    return [readings.get(index) for index in nvml_indices], ""


def forget() -> None:
    """Closes NVML: the next read opens it again (a process whose NVML library or its answers change)."""
    with _lock:
        _readers.clear()
