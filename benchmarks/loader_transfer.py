"""Benchmark: handing batches from DataLoader workers to the main process, torch's
DataLoader against fanrun.data.DataLoader, for batches of one tensor of several sizes.

torch sends every tensor a worker returns through a shared-memory segment of its own and a
descriptor passed over a socket; fanrun.data.DataLoader sends tensors up to
SMALL_TENSOR_BYTES inside the pickled batch. Printed: wall time and the main process's CPU
time per batch (the workers only build the tensor).

    python benchmarks/loader_transfer.py
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.utils.data

from fanrun.data import DataLoader
from fanrun.data._loader import SMALL_TENSOR_BYTES


class Filled(torch.utils.data.Dataset):
    def __init__(self, count: int, sample_bytes: int) -> None:
        self.count, self.elements = count, max(1, sample_bytes // 4)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.elements,), index, dtype=torch.int32)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def per_batch(loader_class, dataset, batch_size: int, workers: int) -> tuple[float, float]:
    loader = loader_class(dataset, batch_size=batch_size, num_workers=workers)
    cpu, started, batches = cpu_seconds(), time.perf_counter(), 0
    for _ in loader:
        batches += 1
    return (time.perf_counter() - started) / batches * 1e6, (cpu_seconds() - cpu) / batches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 4096, 65536, 262144, 1048576],
                        help="bytes per batch")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.workers, args.sizes = 8, 1, [64, 1048576]
    print(f"{args.batches} batches of {args.batch_size} samples, {args.workers} workers; fanrun sends tensors "
          f"up to {SMALL_TENSOR_BYTES} bytes by value")
    print(f"{'bytes/batch':>11}  {'torch wall us':>13}  {'fanrun wall us':>14}  {'torch main CPU us':>17}  "
          f"{'fanrun main CPU us':>18}  {'CPU ratio':>9}")
    for size in args.sizes:
        dataset = Filled(args.batches * args.batch_size, size // args.batch_size)
        torch_wall, torch_cpu = per_batch(torch.utils.data.DataLoader, dataset, args.batch_size, args.workers)
        ours_wall, ours_cpu = per_batch(DataLoader, dataset, args.batch_size, args.workers)
        print(f"{size:>11}  {torch_wall:>13.0f}  {ours_wall:>14.0f}  {torch_cpu:>17.0f}  {ours_cpu:>18.0f}  "
              f"{torch_cpu / ours_cpu:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
