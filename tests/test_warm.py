"""Warm calls: ranks taken from spare interpreters started ahead (backends/local/spares.py), which
return what cold ranks do, are supervised as they are, and leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import fanrun
from fanrun import distributed
from fanrun.backends.local.spares import POOL
from fanrun._rank import contract
from processes import processes_with_environment, wait_gone


@pytest.fixture
def spares():
    """The pool, emptied at the end: no spare of this process may outlive the test."""
    yield POOL
    fanrun.cooldown()
    assert processes_with_environment(f"{contract.ENV_SPARE}={os.getpid()}".encode()) == []


@distributed(num_accelerators=2, warm=True)
def describe(x):
    import os
    import random

    import numpy
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + x)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    return {"rank": os.environ["RANK"], "sum": total.item(), "pid": os.getpid(), "cwd": os.getcwd(),
            "env": os.environ.get("FANRUN_WARM_TEST"), "random": random.random(), "numpy": float(numpy.random.rand()),
            "torch": torch.rand(1).item()}


cold_describe = distributed(num_accelerators=2, warm=False)(describe.__wrapped__)


def test_a_warm_call_runs_on_the_spares_and_returns_what_a_cold_one_does(spares, capfd):
    assert fanrun.warmup(2, wait=True) is True  # torch and numpy, imported here, are imported there
    waiting = spares.pids()
    assert len(waiting) == 2
    warm = describe.distributed(3)
    cold = cold_describe.distributed(3)
    assert sorted(r["pid"] for r in warm) == sorted(waiting)
    for warm_rank, cold_rank in zip(warm, cold, strict=True):
        assert {k: warm_rank[k] for k in ("rank", "sum", "cwd", "env")} == {k: cold_rank[k] for k in ("rank", "sum", "cwd", "env")}
    assert [r["sum"] for r in warm] == [7.0, 7.0]
    out, _ = capfd.readouterr()
    assert "[rank0]: hello from rank 0" in out and "[rank1]: hello from rank 1" in out
    # The next call's spares wait already, and the ones used are gone.
    assert len(spares.pids()) == 2 and not set(spares.pids()) & set(waiting)
    assert wait_gone(waiting, timeout=10) == []


def test_random_streams_differ_across_ranks_and_calls(spares):
    fanrun.warmup(2)
    draws = [(r["random"], r["numpy"], r["torch"]) for _ in range(2) for r in describe.distributed(0)]
    assert all(len({d[i] for d in draws}) == 4 for i in range(3)), draws


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


@distributed(num_accelerators=2, warm=True)
def lineage(wait_for: str | None = None):
    """This rank's pid and its keeper's parent; with `wait_for`, once that file exists."""
    import os
    import time

    while wait_for is not None and not os.path.exists(wait_for):
        time.sleep(0.01)
    return os.getpid(), parent_of(os.getppid())


def test_the_spares_of_a_loop_of_calls_are_forked_from_one_zygote(spares):
    # The first call settles what the spares import (mlflow where calls are tracked).
    fanrun.warmup(2, wait=True)
    lineage.distributed()
    assert spares.wait_ready(60)
    zygote = spares.zygote_pid()
    assert zygote is not None
    for _ in range(3):
        waiting = spares.pids()
        ranks = lineage.distributed()
        # Each rank was a waiting spare, forked from the zygote, under a keeper of its own.
        assert sorted(pid for pid, _ in ranks) == sorted(waiting) and {parent for _, parent in ranks} == {zygote}
    assert spares.zygote_pid() == zygote


def test_spares_forked_from_a_zygote_outlive_it(spares, tmp_path):
    fanrun.warmup(2, wait=True)
    lineage.distributed()
    assert spares.wait_ready(60)
    zygote, forked = spares.zygote_pid(), spares.pids()
    release = tmp_path / "release"
    killer = threading.Timer(0.5, lambda: (os.kill(zygote, signal.SIGKILL), wait_gone([zygote], timeout=10), release.touch()))
    killer.start()
    ranks = lineage.distributed(str(release))
    killer.join()
    # The ranks were the forked spares, whose keepers lost their parent while they ran.
    assert sorted(pid for pid, _ in ranks) == sorted(forked) and zygote not in {parent for _, parent in ranks}
    # The next call's spares come from a new zygote, or by exec while it imports.
    assert wait_gone([zygote], timeout=10) == []
    assert len(lineage.distributed()) == 2 and spares.wait_ready(60)
    assert spares.zygote_pid() not in (None, zygote)


def test_a_caller_holding_threads_gets_warm_ranks_that_work(spares):
    stop = threading.Event()
    busy = [threading.Thread(target=stop.wait) for _ in range(4)]
    for thread in busy:
        thread.start()
    try:
        fanrun.warmup(2)
        waiting = spares.pids()
        results = describe.distributed(1)
        assert sorted(r["pid"] for r in results) == sorted(waiting)
        assert [r["sum"] for r in results] == [3.0, 3.0]
    finally:
        stop.set()
        for thread in busy:
            thread.join()


def test_a_changed_environment_or_sys_path_replaces_the_spares(spares, monkeypatch, tmp_path):
    fanrun.warmup(2)
    first = spares.pids()
    monkeypatch.setenv("FANRUN_WARM_TEST", "changed")
    results = describe.distributed(0)
    assert not {r["pid"] for r in results} & set(first)  # started cold, with the new environment
    assert [r["env"] for r in results] == ["changed", "changed"]
    assert wait_gone(first, timeout=10) == []
    second = spares.pids()
    monkeypatch.syspath_prepend(str(tmp_path))
    results = describe.distributed(0)
    assert not {r["pid"] for r in results} & set(second)
    assert wait_gone(second, timeout=10) == []


def test_files_written_beside_the_callers_code_keep_the_spares_and_a_package_installed_replaces_them(
        spares, monkeypatch, tmp_path):
    packages = tmp_path / "packages"
    packages.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.syspath_prepend("")  # a notebook's working directory
    fanrun.warmup(2, wait=True)
    first = spares.pids()
    (tmp_path / "plot.png").write_bytes(b"")  # its working directory's modification time changes
    assert sorted(r["pid"] for r in describe.distributed(0)) == sorted(first)
    second = spares.pids()
    (packages / "newly_installed").mkdir()
    assert not {r["pid"] for r in describe.distributed(0)} & set(second)
    assert wait_gone(second, timeout=10) == []


def test_a_spare_killed_while_it_waits_leaves_the_call_to_a_cold_rank(spares):
    fanrun.warmup(2)
    killed = spares.pids()[0]
    os.kill(killed, signal.SIGKILL)
    assert wait_gone([killed], timeout=10) == []
    results = describe.distributed(2)
    assert [r["sum"] for r in results] == [5.0, 5.0] and killed not in {r["pid"] for r in results}


@distributed(num_accelerators=2, warm=True)
def rank_1_killed():
    import os
    import signal
    import time

    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_warm_rank_killed_mid_call_is_named_and_the_next_call_works(spares):
    fanrun.warmup(2)
    with pytest.raises(fanrun.RankFailedError, match=r"Rank 1 of 2 \(pid \d+\) was killed by SIGKILL"):
        rank_1_killed.distributed()
    assert [r["sum"] for r in describe.distributed(0)] == [1.0, 1.0]


CALLER = """
import os, sys, fanrun
from fanrun.backends.local.spares import POOL

@fanrun.distributed(num_accelerators=2, warm=True)
def quick():
    return os.getpid()

fanrun.warmup(2)
ranks = quick.distributed()
print(" ".join(map(str, ranks + POOL.pids())), flush=True)
sys.stdin.read()  # until killed
"""


def test_no_spare_outlives_a_caller_killed_with_sigkill(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CALLER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pids = [int(pid) for pid in caller.stdout.readline().split()]
        assert len(pids) == 4, caller.stderr.read()
        spare_pids = pids[2:]
        assert processes_with_environment(f"{contract.ENV_SPARE}={caller.pid}".encode()) != []
    finally:
        caller.kill()
        caller.communicate(timeout=30)
    assert wait_gone(spare_pids, timeout=10) == []
    assert wait_gone([pid for pid, _ in processes_with_environment(f"{contract.ENV_SPARE}={caller.pid}".encode())],
                     timeout=10) == []


INTERRUPTED_CALLER = """
import os, sys, time, fanrun

@fanrun.distributed(num_accelerators=2, warm=True)
def sleep():
    print("up", os.getpid(), flush=True)
    time.sleep(60)

fanrun.warmup(2, wait=True)
try:
    sleep.distributed()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_stops_warm_ranks_and_the_spares_end_with_the_caller(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(INTERRUPTED_CALLER)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    ranks = []
    try:
        while len(ranks) < 2:
            line = caller.stdout.readline()
            assert line, caller.stderr.read()
            if "up " in line:
                ranks.append(int(line.split()[-1]))
        caller.send_signal(signal.SIGINT)
        out, err = caller.communicate(timeout=60)
    finally:
        caller.kill()
    assert "interrupted" in out, err
    assert wait_gone(ranks, timeout=0.5) == []  # stopped before KeyboardInterrupt reached the caller
    assert wait_gone([pid for pid, _ in processes_with_environment(f"{contract.ENV_SPARE}={caller.pid}".encode())],
                     timeout=10) == []


EXITING_CALLER = """
import fanrun

@fanrun.distributed(num_accelerators=1, warm=True)
def warm():
    return 1

@fanrun.distributed(num_accelerators=1, keep_alive=True)
def kept():
    return 2

print(warm.distributed(), kept.distributed(), flush=True)
"""


def test_a_caller_that_ends_with_spares_and_kept_ranks_stops_them_and_reports_no_leak(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(EXITING_CALLER)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ, "FANRUN_TRACKING": "0"})
    out, err = caller.communicate(timeout=120)
    assert caller.returncode == 0 and out.strip() == "[1] [2]", err
    assert "leaked" not in err  # nanobind's report of engine objects alive past the module
    # Stopped before the caller ended, not afterwards by their parent-death signal.
    assert processes_with_environment(f"{contract.ENV_SPARE}={caller.pid}".encode()) == []


def test_warm_switches_are_checked(monkeypatch, spares):
    with pytest.raises(TypeError, match="warm must be True, False or None"):
        distributed(warm="yes")
    with pytest.raises(ValueError, match="preload names modules to import"):
        fanrun.warmup(2, preload=["not a module"])
    from fanrun.backends.local.spares import warm

    monkeypatch.delenv("FANRUN_WARM", raising=False)
    # Left to itself, a function's call is warm where the machine has 4 cores for each rank.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert warm(None, 2, repeatable=True) is True and warm(None, 3, repeatable=True) is False
    assert warm(None, 1, repeatable=False) is False  # a one-off program's: `fanrun run`, a detached run
    assert warm(True, 3, repeatable=True) is True and warm(False, 1, repeatable=True) is False
    fanrun.warmup(1)
    assert warm(None, 3, repeatable=False) is True and warm(False, 1, repeatable=True) is False
    monkeypatch.setenv("FANRUN_WARM", "0")
    assert warm(None, 1, repeatable=True) is False
    fanrun.cooldown()
    monkeypatch.setenv("FANRUN_WARM", "1")
    assert warm(None, 3, repeatable=False) is True
