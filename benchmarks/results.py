"""Benchmark: what returning large tensors from the ranks costs, against torch.save + torch.load of
the same bytes. Each rank makes a tensor of --mb MB (on its GPU with --device cuda) and returns it
or None; the cost of returning is the difference between the two calls' wall times, the caller
reading every returned tensor once (a sum) in both. The peer is torch.save into memory, torch.load
and the same sum, of every rank's tensor in turn, in the caller.
    python benchmarks/results.py                      # 2 ranks x 400 MB, CPU
    python benchmarks/results.py --device cuda        # one rank per GPU, CUDA tensors (they come back on the CPU)
Goal: the cost of returning is at most 1.5x torch.save + torch.load.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import time

GOAL_RATIO = 1.5


def make_and_return(mb: int, device: str, give_back: bool):
    import os

    import torch

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    tensor = torch.full((mb * (1 << 20) // 4,), float(os.environ["RANK"]), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    return tensor if give_back else None


def timed_call(function, mb: int, device: str, give_back: bool) -> float:
    started = time.perf_counter()
    results = function.distributed(mb, device, give_back)
    for rank, tensor in enumerate(results):
        if give_back:
            assert tensor.device.type == "cpu" and float(tensor[-1]) == rank
            tensor.sum()
    return time.perf_counter() - started


def timed_torch_save_load(mb: int, ranks: int) -> float:
    import torch

    tensors = [torch.full((mb * (1 << 20) // 4,), float(rank)) for rank in range(ranks)]
    started = time.perf_counter()
    for tensor in tensors:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        buffer.seek(0)
        torch.load(buffer).sum()
    return time.perf_counter() - started


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=400, help="MB each rank returns (default 400)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2; with --device cuda, at most the GPUs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds; medians are shown (default 5)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.mb, args.repeat = 4, 1
    return args


def decorator_arguments(ranks: int, device: str) -> dict:
    return {"num_accelerators": ranks, "accelerator_type": None if device == "cuda" else "CPU", "tracking": False}


def main() -> None:
    args = parse_args()
    import torch

    from fanrun import distributed

    function = distributed(**decorator_arguments(args.ranks, args.device))(make_and_return)
    print(f"{args.ranks} ranks x {args.mb} MB ({args.device} tensors); Python {platform.python_version()}, "
          f"torch {torch.__version__}, {os.cpu_count()} cores; medians of {args.repeat}", flush=True)
    timed_call(function, args.mb, args.device, True)  # warm: imports and the first result's pages
    nothing, tensors, peer = [], [], []
    for _ in range(args.repeat):  # interleaved, so that drift in the machine's load hits all three
        nothing.append(timed_call(function, args.mb, args.device, False))
        tensors.append(timed_call(function, args.mb, args.device, True))
        peer.append(timed_torch_save_load(args.mb, args.ranks))
    cost = statistics.median(tensors) - statistics.median(nothing)
    baseline = statistics.median(peer)
    print(f"{'call returning None s':>22}  {'call returning tensors s':>24}  {'cost of returning s':>19}  "
          f"{'torch.save+load s':>17}  {'cost / torch':>12}")
    print(f"{statistics.median(nothing):>22.3f}  {statistics.median(tensors):>24.3f}  {cost:>19.3f}  "
          f"{baseline:>17.3f}  {cost / baseline:>11.2f}x")
    verdict = "holds" if cost <= GOAL_RATIO * baseline else "NOT MET"
    print(f"Goal: returning costs at most {GOAL_RATIO}x torch.save + torch.load of the same bytes: {verdict}")


if __name__ == "__main__":
    main()
