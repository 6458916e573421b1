"""GPU scenarios of the core contract, each timed and followed by an nvidia-smi check that no
process is left and no memory held: DDP with NCCL on every GPU, a caller that initialised
CUDA first, a rank raising and a rank SIGKILLed mid-training, and a rank hung in a collective.
With --smoke, the same scenarios on 2 CPU processes with gloo and a small model (the one that
needs CUDA in the caller is left out), so that the script is run where there is no GPU."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402

import fanrun  # noqa: E402
from fanrun import distributed  # noqa: E402


ON_GPU = torch.cuda.is_available()


def gpu_processes() -> str:
    """GPU processes other than this caller, which holds a CUDA context of its own from
    the scenario that initialises CUDA before launching."""
    query = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"]
    lines = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
    return "; ".join(line for line in lines if line.split(",")[0].strip() != str(os.getpid()))


def memory_used() -> str:
    query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip().replace("\n", "; ")


def report(name: str, started: float, outcome: str) -> None:
    print(f"== {name}: {outcome} in {time.monotonic() - started:.2f} s")
    if ON_GPU:
        print(f"   after: GPU processes other than the caller: [{gpu_processes() or 'none'}]; memory used: {memory_used()}", flush=True)


@distributed()
def train_and_maybe_fail(mode: str, failing_rank: int = 1, steps: int = 400) -> float:
    import os
    import signal

    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if on_gpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    width, device = (4096, "cuda") if on_gpu else (64, "cpu")
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(width, width).to(device), device_ids=[local_rank] if on_gpu else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        loss = model(torch.randn(256, width, device=device)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == steps // 2 and dist.get_rank() == failing_rank:
            if on_gpu:
                torch.cuda.synchronize()
            if mode == "raise":
                raise RuntimeError(f"rank {failing_rank} gave up at step {step}")
            if mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                import time

                time.sleep(600)  # rank 0 waits in the next all-reduce
    dist.destroy_process_group()
    return loss.item()


def scenario(name: str, body) -> None:
    """Runs one scenario; a failure is reported and the next scenario still runs."""
    started = time.monotonic()
    try:
        outcome = body()
    except BaseException as error:  # reported, not raised: the other scenarios still run
        outcome = f"FAILED with {type(error).__name__}: {error}"
    report(name, started, outcome)


def ddp_demo() -> str:
    from ddp_demo import run_train

    results = run_train.distributed(num_epochs=3, batch_size=256)
    devices = [r["device"] for r in results]
    return f"{len(results)} ranks on {devices}, loss {results[0]['losses'][0]:.4f} -> {results[0]['losses'][-1]:.4f}"


def cuda_live_in_caller() -> str:
    # The case where notebook launchers built on fork fail: CUDA is live in the caller.
    held = torch.ones(1024, 1024, device="cuda")
    losses = train_and_maybe_fail.distributed("none", steps=50)
    del held
    return f"returned {losses}"


def warm_calls() -> str:
    # Spares are started by exec, never forked from this caller, so CUDA live here is no
    # obstacle; each call's ranks are the spares the call before left, their imports done.
    held = torch.ones(1024, 1024, device="cuda") if ON_GPU else None
    warm = distributed(warm=True)(train_and_maybe_fail.__wrapped__)
    times, cold = [], distributed(warm=False)(train_and_maybe_fail.__wrapped__)
    started = time.monotonic()
    cold.distributed("none", steps=50)
    cold_s = time.monotonic() - started
    fanrun.warmup(wait=True)
    for _ in range(3 if ON_GPU else 1):
        started = time.monotonic()
        losses = warm.distributed("none", steps=50)
        times.append(time.monotonic() - started)
        fanrun.warmup(wait=True)  # the spares this call left, their imports done, as between two cells
    fanrun.cooldown()
    del held
    return (f"cold call {cold_s:.2f} s, then {len(times)} warm calls in {', '.join(f'{t:.2f}' for t in times)} s; "
            f"last losses {[round(loss, 4) for loss in losses]}")


def kept_calls() -> str:
    # keep_alive=True: the second call on runs in the processes of the first, their CUDA context,
    # NCCL libraries and cuBLAS handles still there.
    held = torch.ones(1024, 1024, device="cuda") if ON_GPU else None
    kept = distributed(keep_alive=True)(train_and_maybe_fail.__wrapped__)
    times = []
    for _ in range(4 if ON_GPU else 2):
        started = time.monotonic()
        losses = kept.distributed("none", steps=50)
        times.append(time.monotonic() - started)
    fanrun.cooldown()
    del held
    return (f"first call {times[0]:.2f} s, then {len(times) - 1} calls on the kept ranks in "
            f"{', '.join(f'{t:.2f}' for t in times[1:])} s; last losses {[round(loss, 4) for loss in losses]}")


def failing(mode: str, rank: int, expected: type, steps: int):
    def body() -> str:
        try:
            train_and_maybe_fail.distributed(mode, rank, steps)
        except expected as error:
            return f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return "no error (unexpected)"

    return body


def hung_collective(timeout: float, steps: int):
    def body() -> str:
        return hang(timeout, steps)

    return body


def hang(timeout: float, steps: int) -> str:
    hung = distributed(timeout=timeout)(train_and_maybe_fail.__wrapped__)
    try:
        hung.distributed("hang", 1, steps)
    except TimeoutError as error:
        named = sorted(r for r, lines in error.stacks.items() if any("train_and_maybe_fail" in line for line in lines))
        return f"TimeoutError, ranks running {error.running_ranks}, stacks naming the function from ranks {named}"
    return "no error (unexpected)"


# Holds GPU 0's lock, as a call running on it does, until its stdin closes.
LOCK_HOLDER = """
import sys
from fanrun._accelerators import detect
from fanrun._launch import gpu_locks
with gpu_locks.hold(detect().visible[:1], holder="'another call'", on_busy=print):
    print("held", flush=True)
    sys.stdin.read()
"""
HOLD_S = 3.0


def torch_distributor_file_waits_for_a_held_gpu() -> str:
    """TorchDistributor.run("x.py") goes through the one call path: it takes the GPU's lock, so it
    waits while another call holds it, and says who holds it."""
    import contextlib
    import io
    import tempfile
    import threading

    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train.py"
        script.write_text("import os, torch\nprint('rank', os.environ['RANK'], 'sees', torch.cuda.device_count(), 'GPU')\n")
        holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            if holder.stdout.readline() != "held\n":
                return "the holder did not take the lock (unexpected)"
            threading.Timer(HOLD_S, holder.stdin.close).start()
            said = io.StringIO()
            started = time.monotonic()
            with contextlib.redirect_stderr(said):
                fanrun.TorchDistributor(num_processes=1, use_gpu=True).run(str(script))
            waited = time.monotonic() - started
        finally:
            holder.wait(timeout=30)
    told = [line for line in said.getvalue().splitlines() if "another call" in line]
    if waited < HOLD_S or not told:
        return f"did not wait for the held GPU (unexpected): {waited:.2f} s, told {told}"
    return f"waited {waited:.2f} s while another process held GPU 0, told: {told[0]!r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # One rank per GPU; on CPU (--smoke) two processes. The rank that fails is the last one.
    ranks = torch.cuda.device_count() if ON_GPU else 2
    last = ranks - 1
    parser.add_argument("--raise-rank", type=int, default=last, help="the rank that raises (default: the last)")
    parser.add_argument("--kill-rank", type=int, default=last, help="the rank SIGKILLed (default: the last)")
    parser.add_argument("--smoke", action="store_true",
                        help="where there is no GPU: the scenarios on 2 CPU processes with gloo, that the script still runs")
    args = parser.parse_args()
    if not ON_GPU and not args.smoke:
        parser.error("no GPU found (torch.cuda.is_available() is False); --smoke runs the scenarios on CPU processes")
    steps, timeout = (400, 20.0) if ON_GPU else (20, 10.0)
    if ON_GPU:
        print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
        print(f"before: GPU processes: [{gpu_processes() or 'none'}]; memory used: {memory_used()}", flush=True)
    else:
        print(f"no GPU: 2 CPU processes with gloo; torch {torch.__version__}", flush=True)
    backend = "NCCL" if ON_GPU else "gloo"
    scenario(f"DDP demo, @distributed() on every {'GPU' if ON_GPU else 'CPU process'} with {backend}", ddp_demo)
    if ON_GPU:
        scenario("caller initialised CUDA first", cuda_live_in_caller)
    scenario(f"warm calls{' from a caller with CUDA live' if ON_GPU else ''}", warm_calls)
    scenario(f"kept calls{' from a caller with CUDA live' if ON_GPU else ''}", kept_calls)
    scenario(f"rank {args.raise_rank} raises mid-training", failing("raise", args.raise_rank, RuntimeError, steps))
    scenario(f"rank {args.kill_rank} is SIGKILLed mid-training",
             failing("sigkill", args.kill_rank, fanrun.RankFailedError, steps))
    if ON_GPU:
        scenario("TorchDistributor's .py file waits for a GPU another call holds", torch_distributor_file_waits_for_a_held_gpu)
    if ranks > 1:
        scenario(f"rank 1 hangs, rank 0 waits in {backend} (timeout={timeout:g} s)", hung_collective(timeout, steps))
    else:
        print("== rank 1 hangs, rank 0 waits: not run, it needs 2 ranks and there is 1 GPU", flush=True)


if __name__ == "__main__":
    main()
