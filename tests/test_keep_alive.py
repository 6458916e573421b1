"""@distributed(keep_alive=True): the rank processes stay alive between the calls of a function
(backends/local/spares.py, KeptRanks; _rank/keep.py), each call with its own arguments, output, results
and random seeds; a call that fails, or cannot leave its ranks clean, ends them."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import fanrun
from fanrun import distributed
from fanrun.backends.local import spares
from fanrun._rank import contract
from processes import processes_with_environment, wait_gone


@pytest.fixture(autouse=True)
def ends_kept_ranks():
    """No kept rank of this process may outlive the test."""
    yield
    fanrun.cooldown()
    assert wait_gone(spares.kept_pids(), timeout=10) == []
    assert processes_with_environment(f"{contract.ENV_SPARE}={os.getpid()}".encode()) == []


@distributed(num_accelerators=2, keep_alive=True)
def kept(x):
    import json
    import os
    import random

    import numpy
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + x)])
    dist.all_reduce(total)
    print(f"call {x} on rank {os.environ['RANK']}", flush=True)
    # Left initialised on purpose: a kept rank ends its process group as its exit would.
    left_by_last_call = getattr(json, "_left_by_last_call", None)
    json._left_by_last_call = x
    return {"rank": os.environ["RANK"], "sum": total.item(), "pid": os.getpid(), "cwd": os.getcwd(),
            "random": random.random(), "numpy": float(numpy.random.rand()), "torch": torch.rand(1).item(),
            "left_by_last_call": left_by_last_call}


cold = distributed(num_accelerators=2)(kept.__wrapped__)


def test_kept_ranks_take_every_call_and_return_what_cold_ones_do(capfd):
    calls = [kept.distributed(x) for x in range(3)]
    out, _ = capfd.readouterr()
    for x in range(3):
        assert out.count(f"call {x} on rank 0") == 1 and out.count(f"call {x} on rank 1") == 1
    pids = [r["pid"] for r in calls[0]]
    assert [[r["pid"] for r in call] for call in calls] == [pids] * 3
    assert [[r["sum"] for r in call] for call in calls] == [[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]]
    from_cold = cold.distributed(2)
    assert [{k: r[k] for k in ("rank", "sum", "cwd")} for r in calls[2]] == [
        {k: r[k] for k in ("rank", "sum", "cwd")} for r in from_cold]
    # What persists: the modules a call imported, with what it left in them.
    assert [r["left_by_last_call"] for r in calls[2]] == [1, 1]
    # What does not: each call draws from fresh seeds.
    for stream in ("random", "numpy", "torch"):
        assert len({r[stream] for call in calls for r in call}) == 6, stream


@distributed(num_accelerators=2, keep_alive=True)
def fails_on(failing_rank):
    import os

    if os.environ["RANK"] == str(failing_rank):
        raise ValueError("rank gave up")
    return os.getpid()


def test_a_failed_call_ends_the_kept_ranks_and_the_next_call_starts_afresh():
    pids = fails_on.distributed(-1)
    assert fails_on.distributed(-1) == pids
    with pytest.raises(ValueError, match="rank gave up"):
        fails_on.distributed(1)
    assert wait_gone(pids, timeout=10) == []
    again = fails_on.distributed(-1)
    assert not set(again) & set(pids)


@distributed(num_accelerators=2, keep_alive=True)
def leaves_a_thread(seconds):
    import os
    import threading
    import time

    threading.Thread(target=time.sleep, args=(seconds,), name="still-busy").start()
    return os.getpid()


def test_a_call_that_leaves_a_thread_running_ends_its_ranks_as_cold_ones_end(capfd):
    pids = leaves_a_thread.distributed(0.5)
    _, err = capfd.readouterr()
    assert "the ranks end after this call instead of staying for the next (keep_alive)" in err
    assert "threads the function started still run (still-busy)" in err
    assert wait_gone(pids, timeout=10) == []
    assert not set(leaves_a_thread.distributed(0)) & set(pids)


@distributed(num_accelerators=2, keep_alive=True)
def ddp_step():
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    dist.destroy_process_group()
    return os.getpid()


def test_ranks_that_torch_left_a_gloo_group_in_end_after_their_call(capfd):
    """DistributedDataParallel over gloo leaves its process group's threads behind; replacing
    that group in a later call can hang, so such ranks end as cold ones do."""
    pids = ddp_step.distributed()
    _, err = capfd.readouterr()
    assert "torch kept a gloo process group alive after destroy_process_group" in err
    assert wait_gone(pids, timeout=10) == []
    assert not set(ddp_step.distributed()) & set(pids)


@distributed(num_accelerators=2, keep_alive=True)
def starts_children():
    """Starts a plain child, one in a session of its own and a double-forked one; the rank's pid
    and theirs."""
    import os

    from test_faults_launch import start_children

    return os.getpid(), start_children()


def test_a_kept_call_ends_every_process_it_started_and_its_ranks_serve_the_next():
    """As a cold rank's keeper kills what the rank started when it exits, a kept rank kills
    (and reaps) everything below it when its call is over: a plain child, one in its own
    session, a double-forked one. The ranks stay, and take the next call."""
    first = starts_children.distributed()
    for rank, children in first:
        assert [pid for pid in children if os.path.exists(f"/proc/{pid}")] == [], f"left by rank pid {rank}"
    second = starts_children.distributed()
    assert [rank for rank, _ in second] == [rank for rank, _ in first]
    assert [pid for _, children in second for pid in children if os.path.exists(f"/proc/{pid}")] == []


@distributed(num_accelerators=2, keep_alive=True)
def uses_a_fork_server():
    import multiprocessing
    import multiprocessing.forkserver
    import os

    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        values = pool.map(abs, [-1, -2])
    return os.getpid(), multiprocessing.forkserver._forkserver._forkserver_pid, values


def test_multiprocessing_fork_servers_a_kept_call_leaves_are_ended_and_start_afresh_in_the_next():
    """multiprocessing's fork server (and its resource tracker) outlive a pool: they end with the
    call too, their own way, so that the next call on the same ranks starts them afresh."""
    first = uses_a_fork_server.distributed()
    assert [values for _, _, values in first] == [[1, 2], [1, 2]]
    assert [server for _, server, _ in first if os.path.exists(f"/proc/{server}")] == []
    second = uses_a_fork_server.distributed()
    assert [rank for rank, _, _ in second] == [rank for rank, _, _ in first]
    assert [values for _, _, values in second] == [[1, 2], [1, 2]]


# Long enough for a cold start on a loaded machine; the timeout test shortens it once the ranks are up.
@distributed(num_accelerators=2, keep_alive=True, timeout=120)
def sleeps(seconds):
    import os
    import time

    time.sleep(seconds)
    return os.getpid()


def test_a_timeout_in_a_kept_call_dumps_the_stacks_and_ends_the_ranks(monkeypatch):
    pids = sleeps.distributed(0)
    monkeypatch.setattr(sleeps, "_options", dataclasses.replace(sleeps._options, timeout=3))
    with pytest.raises(TimeoutError) as raised:
        sleeps.distributed(60)
    assert "Python stacks dumped before the kill: ranks 0, 1." in str(raised.value)
    # Rank 1's dump holds its main thread in `sleeps`, whichever of its threads comes first.
    assert re.search(r"--- rank 1 ---\n(?:(?!--- rank).)*line \d+ in sleeps", str(raised.value), re.S)
    assert wait_gone(pids, timeout=10) == []


def test_idle_ranks_end_after_the_idle_timeout_with_cooldown_and_with_their_function(monkeypatch):
    monkeypatch.setattr(spares, "IDLE_TIMEOUT_S", 0.5)
    idle = sleeps.distributed(0)
    assert wait_gone(idle, timeout=10) == []
    monkeypatch.undo()
    cooled = sleeps.distributed(0)
    fanrun.cooldown()
    assert wait_gone(cooled, timeout=10) == []

    def own(): return os.getpid()  # noqa: E704

    function = distributed(num_accelerators=2, keep_alive=True)(own)
    forgotten = function.distributed()
    del function
    gc.collect()
    assert wait_gone(forgotten, timeout=10) == []


def test_a_changed_environment_replaces_the_kept_ranks(monkeypatch):
    before = sleeps.distributed(0)
    monkeypatch.setenv("FANRUN_KEEP_ALIVE_TEST", "1")
    after = sleeps.distributed(0)
    assert not set(after) & set(before)
    assert wait_gone(before, timeout=10) == []


CALLER = """
import os, sys, fanrun

@fanrun.distributed(num_accelerators=2, keep_alive=True)
def pid():
    return os.getpid()

print(" ".join(map(str, pid.distributed())), flush=True)
sys.stdin.read()  # until killed
"""


def test_no_kept_rank_outlives_a_caller_killed_with_sigkill(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CALLER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pids = [int(pid) for pid in caller.stdout.readline().split()]
        assert len(pids) == 2, caller.stderr.read()
        assert wait_gone(pids, timeout=0.5) == pids  # kept
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.communicate(timeout=30)
    assert wait_gone(pids, timeout=10) == []


def test_keep_alive_is_checked():
    with pytest.raises(TypeError, match="keep_alive must be True or False"):
        distributed(keep_alive="yes")
    with pytest.raises(ValueError, match="keep_alive=True keeps the ranks of this machine"):
        distributed(num_accelerators=4, nodes=2, keep_alive=True)
