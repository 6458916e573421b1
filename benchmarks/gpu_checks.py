"""GPU scenarios of the core contract, each timed and followed by an nvidia-smi check that no
process is left and no memory held: DDP with NCCL on every GPU, a caller that initialised
CUDA first, a rank raising and a rank SIGKILLed mid-training, and a rank hung in a collective."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402

import fanrun  # noqa: E402
from fanrun import distributed  # noqa: E402


def gpu_processes() -> str:
    query = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip()


def memory_used() -> str:
    query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip().replace("\n", "; ")


def report(name: str, started: float, outcome: str) -> None:
    print(f"== {name}: {outcome} in {time.monotonic() - started:.2f} s")
    print(f"   after: GPU processes: [{gpu_processes() or 'none'}]; memory used: {memory_used()}", flush=True)


@distributed()
def train_and_maybe_fail(mode: str, steps: int = 400) -> float:
    import os
    import signal

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4096, 4096).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        loss = model(torch.randn(256, 4096, device="cuda")).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == steps // 2 and dist.get_rank() == 1:
            torch.cuda.synchronize()
            if mode == "raise":
                raise RuntimeError(f"rank 1 gave up at step {step}")
            if mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                import time

                time.sleep(600)  # rank 0 waits in the next all-reduce
    dist.destroy_process_group()
    return loss.item()


def main() -> None:
    print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"before: GPU processes: [{gpu_processes() or 'none'}]; memory used: {memory_used()}", flush=True)

    from ddp_demo import run_train

    started = time.monotonic()
    results = run_train.distributed(num_epochs=3, batch_size=256)
    report("DDP demo, @distributed() on every GPU with NCCL", started,
           f"{len(results)} ranks on {[r['device'] for r in results]}, loss {results[0]['losses'][0]:.4f} -> {results[0]['losses'][-1]:.4f}")

    # The case where notebook launchers built on fork fail: CUDA is live in the caller.
    held = torch.ones(1024, 1024, device="cuda")
    started = time.monotonic()
    losses = train_and_maybe_fail.distributed("none", steps=50)
    report("caller initialised CUDA first", started, f"returned {losses}")
    del held

    for mode, expected in (("raise", RuntimeError), ("sigkill", fanrun.RankFailedError)):
        started = time.monotonic()
        try:
            train_and_maybe_fail.distributed(mode)
            outcome = "no error (unexpected)"
        except expected as error:
            outcome = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        report(f"rank 1 fails mid-training ({mode})", started, outcome)

    hang = distributed(timeout=20)(train_and_maybe_fail.__wrapped__)
    started = time.monotonic()
    try:
        hang.distributed("hang")
        outcome = "no error (unexpected)"
    except TimeoutError as error:
        ranks_with_stack = sorted(r for r, lines in error.stacks.items() if any("train_and_maybe_fail" in l for l in lines))
        outcome = f"TimeoutError, ranks running {error.running_ranks}, stacks naming the function from ranks {ranks_with_stack}"
    report("rank 1 hangs, rank 0 waits in NCCL (timeout=20 s)", started, outcome)


if __name__ == "__main__":
    main()
