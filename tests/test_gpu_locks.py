"""One lock per GPU (_launch/gpu_locks.py): a call that finds its GPUs held by another says who
holds them and waits; the lock ends with its holder, however it ends."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from fanrun._accelerators import Gpu
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
