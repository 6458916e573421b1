"""What each rank of the deep health check does on its GPU: bf16 matrix products, a device-to-device
copy and an all-reduce over every GPU of the check, timed. Imported by the ranks: standard library
at the top, torch inside."""

from __future__ import annotations

import os
import time

MATRIX = 8192  # bf16 products this large keep a H100's tensor cores busy
COPY_BYTES = 1 << 30
ALL_REDUCE_BYTES = 256 << 20


def measure(matmul_s: float, copy_s: float, all_reduce_s: float) -> dict:
    """This rank's figures: bf16_tflops, copy_tbps (bytes read and written per second) and, with
    more than one rank, all_reduce_bus_gbps (NCCL's bus bandwidth)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"the deep health check runs CUDA work on every GPU, and this torch ({torch.__version__}) "
                           f"sees no CUDA GPU (torch.cuda.is_available() is False)")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    figures = {"bf16_tflops": _matmul(torch, matmul_s), "copy_tbps": _copy(torch, copy_s)}
    if int(os.environ["WORLD_SIZE"]) > 1:
        figures["all_reduce_bus_gbps"] = _all_reduce(torch, all_reduce_s)
    return figures


def _timed(torch, step, seconds: float) -> tuple[int, float]:
    """Runs `step` for about `seconds` after a warm-up: (steps, seconds taken)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    steps, start = 0, time.perf_counter()
    while True:
        for _ in range(10):
            step()
        steps += 10
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps, elapsed


def _matmul(torch, seconds: float) -> float:
    a = torch.randn(MATRIX, MATRIX, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATRIX, MATRIX, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    steps, elapsed = _timed(torch, lambda: torch.matmul(a, b, out=out), seconds)
    return 2 * MATRIX**3 * steps / elapsed / 1e12


def _copy(torch, seconds: float) -> float:
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    steps, elapsed = _timed(torch, lambda: target.copy_(source), seconds)
    return 2 * COPY_BYTES * steps / elapsed / 1e12  # each byte read once and written once


def _all_reduce(torch, seconds: float) -> float:
    import torch.distributed as dist

    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        tensor = torch.ones(ALL_REDUCE_BYTES // 2, dtype=torch.bfloat16, device="cuda")

        def run(steps: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                dist.all_reduce(tensor)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        run(3)  # warm-up: NCCL's connections
        # Every rank must run as many steps as the others: the fewest any estimated, so the slowest ends in time.
        estimate = torch.tensor([max(10, min(5000, int(seconds / (run(10) / 10))))], device="cuda")
        dist.all_reduce(estimate, op=dist.ReduceOp.MIN)
        steps = int(estimate.item())
        elapsed = run(steps)
        ranks = dist.get_world_size()
        # nccl-tests' bus bandwidth: what each link carries, comparable across rank counts.
        return ALL_REDUCE_BYTES * 2 * (ranks - 1) / ranks * steps / elapsed / 1e9
    finally:
        dist.destroy_process_group()
