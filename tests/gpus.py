"""Marks for the tests that need GPUs: they run on a GPU machine and are skipped elsewhere."""

from __future__ import annotations

import pytest

from fanrun._accelerators import detect

GPU_COUNT = len(detect().visible)


def needs_gpus(count: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(GPU_COUNT < count, reason=f"needs {count} GPU(s); this machine has {GPU_COUNT}")
