"""Training throughput (steps/s) of DDP and FSDP under fanrun and under torchrun, from one run on
the same machine: once training runs, the launcher must cost nothing (ratio 1.00 within noise).
"kept" is fanrun with keep_alive=True: from its second call on, the ranks are the processes of
the call before. "unwatched" is fanrun with on_stall=None: its ranks keep no progress record and no
flight recorder, so fanrun/unwatched is what the stall watch costs the training loop.

    python benchmarks/throughput.py [--steps 200] [--repeat 3] [--ranks N] [--kinds ddp fsdp]

Each rank times its own training loop after a warm-up; rank 0's figure is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def train(kind: str, steps: int, warmup: int) -> float:
    """Steps per second of this rank's loop, after `warmup` steps."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    width, depth, batch = (1024, 4, 64) if on_gpu else (256, 2, 16)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth))).to(device)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = torch.randn(batch, 128, width, device=device)

    def step() -> None:
        loss = model(inputs).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    if on_gpu:
        torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if on_gpu:
        torch.cuda.synchronize()
    rate = steps / (time.perf_counter() - started)
    dist.destroy_process_group()
    return rate


def under_fanrun(kind: str, ranks: int, steps: int, warmup: int, on_stall: str | None = "report") -> float:
    from fanrun import distributed

    return distributed(num_accelerators=ranks, tracking=False, on_stall=on_stall)(train).distributed(kind, steps, warmup)[0]


_KEPT: dict[tuple[str, int], object] = {}


def under_fanrun_kept(kind: str, ranks: int, steps: int, warmup: int) -> float:
    from fanrun import distributed

    if (kind, ranks) not in _KEPT:
        _KEPT[kind, ranks] = distributed(num_accelerators=ranks, tracking=False, keep_alive=True)(train)
    return _KEPT[kind, ranks].distributed(kind, steps, warmup)[0]


def under_torchrun(kind: str, ranks: int, steps: int, warmup: int) -> float:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               __file__, "--worker", kind, "--steps", str(steps), "--warmup", str(warmup)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(next(line.split()[-1] for line in done.stdout.splitlines() if line.startswith("rate ")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=None, help="default: every GPU, else 2")
    parser.add_argument("--kinds", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    parser.add_argument("--worker", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeat = 5, 1, 1
    if args.worker:  # a torchrun rank
        rate = train(args.worker, args.steps, args.warmup)
        if os.environ["RANK"] == "0":
            print(f"rate {rate}")
        return

    import torch

    ranks = args.ranks or (torch.cuda.device_count() or 2)
    where = f"{ranks} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else f"{ranks} CPU processes"
    print(f"{where}; torch {torch.__version__}; {args.steps} timed steps after {args.warmup}, {args.repeat} repeats, alternating")
    print(f"{'model':6} {'fanrun steps/s':>16} {'kept steps/s':>13} {'unwatched steps/s':>18} {'torchrun steps/s':>17} "
          f"{'fanrun/torchrun':>16} {'kept/torchrun':>14} {'fanrun/unwatched':>17}")
    for kind in args.kinds:
        fanrun_rates, kept_rates, unwatched_rates, torchrun_rates = [], [], [], []
        for _ in range(args.repeat):  # alternate, so that drift hits all alike
            fanrun_rates.append(under_fanrun(kind, ranks, args.steps, args.warmup))
            kept_rates.append(under_fanrun_kept(kind, ranks, args.steps, args.warmup))
            unwatched_rates.append(under_fanrun(kind, ranks, args.steps, args.warmup, on_stall=None))
            torchrun_rates.append(under_torchrun(kind, ranks, args.steps, args.warmup))
        f, k, u, t = (statistics.median(rates) for rates in (fanrun_rates, kept_rates, unwatched_rates, torchrun_rates))
        shown = ", ".join(f"{name} {[round(r, 2) for r in rates]}"
                          for name, rates in (("fanrun", fanrun_rates), ("kept", kept_rates),
                                              ("unwatched", unwatched_rates), ("torchrun", torchrun_rates)))
        print(f"{kind:6} {f:16.2f} {k:13.2f} {u:18.2f} {t:17.2f} {f / t:15.3f}x {k / t:13.3f}x {f / u:16.3f}x   ({shown})")
    import fanrun

    fanrun.cooldown()  # the kept ranks


if __name__ == "__main__":
    main()
