"""One lock per GPU (_launch/gpu_locks.py): a call that finds its GPUs held by another says who
holds them and waits; the lock ends with its holder, however it ends."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from fanrun._accelerators import Gpu
from fanrun._errors import UnsafePathError
from fanrun._launch import gpu_locks

GPUS = (Gpu(0, "Test GPU", "GPU-fanrun-test-0", 1 << 30), Gpu(1, "Test GPU", "GPU-fanrun-test-1", 1 << 30))

HOLDER = """
import sys, time
from fanrun._accelerators import Gpu
from fanrun._launch import gpu_locks
with gpu_locks.hold((Gpu(1, "Test GPU", "GPU-fanrun-test-1", 1 << 30),), holder="'the other call'", on_busy=print):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_busy_gpu_is_named_then_waited_for_until_its_holder_ends():
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        told = []

        def on_busy(text):
            told.append(text)
            holder.kill()  # the holder dies without letting go: its lock goes with it

        started = time.monotonic()
        with gpu_locks.hold(GPUS, holder="'this call'", on_busy=on_busy):
            waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.communicate()
    assert told == ["GPU 1 (Test GPU) is in use by 'the other call' (pid %d); waiting until it is free" % holder.pid]
    assert waited < 30


def test_free_gpus_are_taken_without_a_word():
    told = []
    with gpu_locks.hold(GPUS, holder="'this call'", on_busy=told.append):
        pass
    with gpu_locks.hold((), holder="'no GPU'", on_busy=told.append):
        pass
    assert told == []


@pytest.mark.parametrize("uuid", ["../../escaped", "GPU-1/../../escaped", "{tmp}/escaped", "GPU-", "GPU-a\x00b", ""])
def test_a_gpu_uuid_that_is_not_one_is_refused_naming_it_and_nothing_is_made(uuid, tmp_path, monkeypatch):
    """The lock's file name is made of the GPU's UUID: one that is not a UUID (a path, '..', a
    NUL) is refused, naming it, before any lock file is opened, so that nothing is made outside
    locks/ (nor in it)."""
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(tmp_path / "runs" / "root"))
    monkeypatch.chdir(tmp_path)
    uuid = uuid.format(tmp=tmp_path)
    planted = (Gpu(0, "Test GPU", "GPU-fanrun-test-0", 1 << 30), Gpu(1, "Planted GPU", uuid, 1 << 30))
    with pytest.raises(UnsafePathError) as refused:
        with gpu_locks.hold(planted, holder="'this call'", on_busy=print):
            pass
    assert f"GPU 1 (Planted GPU) has the UUID {uuid!r}, which is not a GPU UUID" in str(refused.value)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
