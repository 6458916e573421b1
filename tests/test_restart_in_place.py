"""Restarts that keep the processes (max_restarts): when a rank fails, the others abandon the
attempt in their processes (their process group aborted), the failed rank is replaced by a
spare, and the function is called again in the survivors, which resume from the checkpoint.
Real ranks, gloo on CPU (NCCL and a failed CUDA context where a GPU is); conftest proves that nothing is left running after each test."""

from __future__ import annotations

import os
import time

import pytest
from gpus import needs_gpus
from processes import alive, wait_gone

import fanrun
from fanrun import distributed
from fanrun._rank.abandon import _poisoned

STEPS = 8


def train(directory: str, fail_at: int, how: str, backend: str = "gloo"):
    """STEPS steps: each adds step + 1 to a weight through an all-reduce, and rank 0 checkpoints
    it after every step. On the first attempt rank 1 (rank 0 alone) fails after step `fail_at`,
    killed by SIGKILL or by raising. Returns the weight, this process's pid and the steps this
    attempt did. With nccl, the weight and the all-reduce are on the rank's GPU."""
    import signal

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, attempt = dist.get_rank(), int(os.environ["FANRUN_RESTART_COUNT"])
    failing = min(1, dist.get_world_size() - 1)
    checkpoint = os.path.join(directory, "checkpoint.pt")
    weight, start = torch.zeros(1, device=device), 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location=device)
        weight, start = state["weight"], state["step"]
    note_pid(directory, attempt)
    for step in range(start, STEPS):
        update = torch.tensor([float(step + 1)], device=device)
        dist.all_reduce(update)
        weight += update / dist.get_world_size()
        if rank == 0:
            torch.save({"weight": weight, "step": step + 1}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
        dist.barrier()  # the checkpoint is written before any rank fails
        if attempt == 0 and rank == failing and step + 1 == fail_at:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank 1 fails after step {fail_at}")
    dist.destroy_process_group()
    return float(weight), os.getpid(), STEPS - start, os.environ["FANRUN_RUN_ID"]


def note_pid(directory: str, attempt: int) -> None:
    """In a rank: its pid, for pids() to read."""
    with open(os.path.join(directory, f"pid-{os.environ['RANK']}-{attempt}"), "w") as out:
        out.write(str(os.getpid()))


def wait_for(path: str) -> None:
    """In a rank: until another rank has made `path` (at most a minute)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def pids(directory, world_size: int, attempt: int) -> list[int]:
    return [int((directory / f"pid-{rank}-{attempt}").read_text()) for rank in range(world_size)]


def check_rank_0_replaced(directory, results: list, err: str, why: str) -> None:
    """Two ranks, rank 1 failed on the first attempt: rank 0 was not kept, for `why`, so that the
    second attempt (whose ranks return their pids) ran in new processes, and the first's are gone."""
    first = pids(directory, 2, 0)
    assert results == pids(directory, 2, 1) and results[0] != first[0] and results[1] != first[1]
    assert f"rank 0 ends instead of taking the next attempt: {why}" in err, err
    assert not any(alive(pid) for pid in first)


@pytest.mark.parametrize("how, world_size", [("kill", 3), ("raise", 2)])
def test_the_ranks_that_did_not_fail_keep_their_processes_and_resume_from_the_checkpoint(tmp_path, capfd, how,
                                                                                         world_size):
    fail_at = 3
    started = time.time()
    results = distributed(num_accelerators=world_size, max_restarts=1)(train).distributed(str(tmp_path), fail_at, how)
    wall_s = time.time() - started
    first, second = pids(tmp_path, world_size, 0), pids(tmp_path, world_size, 1)
    # Every step is in the final model once: the weight is 1 + 2 + ... + STEPS on every rank.
    assert [weight for weight, *_ in results] == [STEPS * (STEPS + 1) / 2] * world_size
    # The second attempt resumed from the checkpoint after step fail_at, and did the rest alone.
    assert [steps for _, _, steps, _ in results] == [STEPS - fail_at] * world_size
    survivors = [rank for rank in range(world_size) if rank != 1]
    assert [second[rank] for rank in survivors] == [first[rank] for rank in survivors]
    assert second[1] != first[1] and [pid for _, pid, _, _ in results] == second
    err = capfd.readouterr().err
    kept = "rank 0 in its process" if world_size == 2 else "ranks 0, 2 in their processes"
    assert f"; keeping {kept}, starting rank 1 again\n" in err, err
    # The failed rank's process is gone; the survivors end with the call (they were its spares).
    assert wait_gone([first[1]], timeout=10) == []
    assert wait_gone(second, timeout=10) == []
    # The goodput ledger adds up to the call's wall time, and counts the restart.
    ledger = fanrun.Run(results[0][3]).goodput
    assert ledger is not None and ledger.attempts == 2
    assert sum(ledger.parts.values()) == pytest.approx(ledger.wall_s, abs=1e-6)
    # Measured around the call, the wall time also holds what precedes the ledger (the plan, the payload).
    assert ledger.wall_s == pytest.approx(wall_s, rel=0.01, abs=0.15) and ledger.parts["restart"] > 0


@needs_gpus(1)
def test_a_rank_killed_at_step_k_on_a_gpu_resumes_from_the_checkpoint_over_nccl(tmp_path, capfd):
    # One GPU: the rank that dies is the only one, so a spare takes its place; every step is still
    # in the final model once, and the ledger holds the restart.
    fail_at = 3
    started = time.time()
    results = distributed(num_accelerators=1, max_restarts=1)(train).distributed(str(tmp_path), fail_at, "kill", "nccl")
    wall_s = time.time() - started
    first, second = pids(tmp_path, 1, 0), pids(tmp_path, 1, 1)
    assert [(weight, steps) for weight, _, steps, _ in results] == [(STEPS * (STEPS + 1) / 2, STEPS - fail_at)]
    assert second != first and "; starting every rank again\n" in capfd.readouterr().err
    assert wait_gone(first + second, timeout=10) == []
    ledger = fanrun.Run(results[0][3]).goodput
    assert ledger is not None and ledger.attempts == 2 and ledger.steps_lost == 0
    assert sum(ledger.parts.values()) == pytest.approx(ledger.wall_s, abs=1e-6)
    assert ledger.wall_s == pytest.approx(wall_s, rel=0.01, abs=0.15) and ledger.parts["restart"] > 0


def break_cuda_then_wait(directory: str):
    """On the first attempt rank 0 makes its CUDA context fail (a device-side assert), swallows
    the error, as code that retries a step might, and waits; rank 1, which needs no GPU, then
    fails. Rank 0's function ends by the abandon signal, with no CUDA error of its own: only its
    context shows the failure."""
    attempt = int(os.environ["FANRUN_RESTART_COUNT"])
    note_pid(directory, attempt)
    if attempt == 0 and os.environ["RANK"] == "0":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the ranks are CPU processes; this one takes the GPU
        import torch

        values = torch.zeros(1, device="cuda")
        try:
            values[torch.tensor([10], device="cuda")] += 1  # out of bounds: the kernel asserts
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - swallowed on purpose: the context stays broken
            pass
        open(os.path.join(directory, "broken"), "w").close()
        time.sleep(3600)  # until the abandon signal
    if attempt == 0:
        wait_for(os.path.join(directory, "broken"))
        raise RuntimeError("rank 1 fails")
    return os.getpid()


@needs_gpus(1)
def test_a_rank_whose_cuda_context_failed_is_replaced_not_kept(tmp_path, capfd):
    call = distributed(num_accelerators=2, accelerator_type="CPU", max_restarts=1)(break_cuda_then_wait)
    results = call.distributed(str(tmp_path))
    err = capfd.readouterr().err
    check_rank_0_replaced(tmp_path, results, err, "its CUDA context failed")
    assert "; starting every rank again\n" in err


def fail_to_abort(directory: str):
    """On the first attempt rank 0's process group cannot be aborted (as an NCCL communicator
    that hangs in its abort), and rank 1 fails while rank 0 waits in its function."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.init_process_group("gloo")
    attempt = int(os.environ["FANRUN_RESTART_COUNT"])
    note_pid(directory, attempt)
    if attempt == 0 and dist.get_rank() == 0:
        def cannot_abort(*args, **kwargs):
            raise RuntimeError("the communicator did not abort")

        distributed_c10d._abort_process_group = cannot_abort
        time.sleep(3600)  # until the abandon signal
    if attempt == 0:
        wait_for(os.path.join(directory, "pid-0-0"))
        raise RuntimeError("rank 1 fails")
    dist.destroy_process_group()
    return os.getpid()


def test_a_rank_whose_process_group_could_not_be_aborted_is_replaced(tmp_path, capfd):
    results = distributed(num_accelerators=2, max_restarts=1)(fail_to_abort).distributed(str(tmp_path))
    check_rank_0_replaced(tmp_path, results, capfd.readouterr().err,
                          "its process group could not be aborted (RuntimeError: the communicator did not abort)")


def test_a_cuda_error_anywhere_in_a_failures_chain_marks_the_process_unfit():
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as cause:
            raise ValueError("the step failed") from cause
    except ValueError as error:
        assert "its function failed with a CUDA error" in _poisoned(error)
    assert _poisoned(ValueError("no GPU involved")) is None


def test_restart_fresh_starts_every_rank_in_a_new_process(tmp_path, capfd):
    results = distributed(num_accelerators=2, max_restarts=1, restart="fresh")(train).distributed(str(tmp_path), 3,
                                                                                                   "raise")
    first, second = pids(tmp_path, 2, 0), pids(tmp_path, 2, 1)
    assert [weight for weight, *_ in results] == [STEPS * (STEPS + 1) / 2] * 2
    assert not set(first) & set(second) and [pid for _, pid, _, _ in results] == second
    assert "; starting every rank again\n" in capfd.readouterr().err
    assert wait_gone(first + second, timeout=10) == []


@pytest.mark.parametrize("value", ["in_place", None, True])
def test_a_restart_that_is_neither_keep_nor_fresh_is_refused_when_decorating(value):
    with pytest.raises(ValueError, match=r"restart must be one of 'keep', 'fresh'.*not " + repr(value)):
        distributed(max_restarts=1, restart=value)


def leave_a_thread(directory: str):
    """On the first attempt rank 0 starts a thread that outlives the function, and rank 1 fails."""
    import threading

    attempt = int(os.environ["FANRUN_RESTART_COUNT"])
    if attempt == 0 and os.environ["RANK"] == "0":
        threading.Thread(target=time.sleep, args=(3600,), name="left-behind").start()
    note_pid(directory, attempt)
    if attempt == 0 and os.environ["RANK"] == "0":
        time.sleep(3600)  # until the abandon signal
    if attempt == 0:
        wait_for(os.path.join(directory, "pid-0-0"))  # rank 0 is in its function, and its thread runs
        raise RuntimeError("rank 1 fails")
    return os.getpid()


def test_a_rank_whose_function_left_a_thread_running_is_replaced_too(tmp_path, capfd):
    results = distributed(num_accelerators=2, max_restarts=1)(leave_a_thread).distributed(str(tmp_path))
    err = capfd.readouterr().err
    check_rank_0_replaced(tmp_path, results, err, "threads the function started still run (left-behind)")
    assert "; starting every rank again\n" in err


def stop_in_an_import(directory: str):
    """On the first attempt rank 0 imports a package whose __init__ has imported a submodule and
    then waits, so that the abandon signal stops the import halfway; rank 1 fails meanwhile."""
    import sys

    attempt = int(os.environ["FANRUN_RESTART_COUNT"])
    sys.path.insert(0, directory)
    note_pid(directory, attempt)
    if attempt == 0 and os.environ["RANK"] == "1":
        wait_for(os.path.join(directory, "importing"))
        raise RuntimeError("rank 1 fails")
    import halfway

    return halfway.part.VALUE


def test_a_rank_stopped_halfway_through_an_import_is_replaced(tmp_path, capfd):
    package = tmp_path / "halfway"
    package.mkdir()
    (package / "part.py").write_text("VALUE = 42\n")
    (package / "__init__.py").write_text(
        "import os, time\n"
        "from halfway import part\n"
        "if os.environ['FANRUN_RESTART_COUNT'] == '0':\n"
        f"    open({str(tmp_path / 'importing')!r}, 'w').close()\n"
        "    time.sleep(3600)  # until the abandon signal\n")
    results = distributed(num_accelerators=2, max_restarts=1)(stop_in_an_import).distributed(str(tmp_path))
    assert results == [42, 42]
    first, second = pids(tmp_path, 2, 0), pids(tmp_path, 2, 1)
    assert second[0] != first[0] and second[1] != first[1]
    err = capfd.readouterr().err
    assert ("rank 0 ends instead of taking the next attempt: it was stopped while importing halfway, "
            "whose submodules stay imported without it") in err, err
    assert not any(alive(pid) for pid in first)
