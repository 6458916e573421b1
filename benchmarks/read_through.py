"""Benchmark: large files from a cold disk, read whole by their reader (what a transform that
calls read() does) or first read through by the engine's prefetcher (VolumeDataset's way for
local files of 1 MiB or more: one file ahead, the reader waiting for its file), against `cat`.

P processes each read their share of the files in one shuffled order; the files are dropped
from the page cache before each try. Besides the rate, the disk's own counters
(/proc/diskstats) give the mean size of the requests it served: the read-through's gain.

    python benchmarks/read_through.py --dir /path/on/the/disk     # 200 x 10 MB, kept there
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import time
from multiprocessing import Process
from pathlib import Path

from data import Corpus, evict, files_of, make_corpus  # benchmarks/data.py's corpus, made the same way


def disk_of(path: str) -> str | None:
    """The block device under path, as /proc/diskstats names it."""
    dev = os.stat(path).st_dev
    link = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    return link.resolve().name if link.exists() else None


def disk_reads(disk: str | None) -> tuple[int, int]:
    """(requests, sectors) read so far by the disk; (0, 0) if it is not listed."""
    with open("/proc/diskstats") as stats:
        for line in stats:
            fields = line.split()
            if fields[2] == disk:
                return int(fields[3]), int(fields[5])
    return 0, 0


def cat(paths: list[str]) -> None:
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)


def whole(paths: list[str]) -> None:
    for path in paths:
        with open(path, "rb") as file:
            file.read()


def read_through(paths: list[str]) -> None:
    from fanrun import _core

    prefetcher = _core.LocalPrefetcher(4)  # VolumeDataset's cache_threads
    prefetcher.hint(paths[:1])
    for i, path in enumerate(paths):
        if i + 1 < len(paths):
            prefetcher.hint([paths[i + 1]])  # one 10 MB file ahead, as VolumeDataset reads them
        prefetcher.wait(path)
        with open(path, "rb") as file:
            file.read()


def timed(way, directory: Path, paths: list[str], processes: int, disk: str | None) -> str:
    order = paths[:]
    random.Random(0).shuffle(order)
    evict(directory)
    requests, sectors = disk_reads(disk)
    started = time.perf_counter()
    workers = [Process(target=way, args=(order[i::processes],)) for i in range(processes)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    total = sum(os.path.getsize(p) for p in paths)
    requests_after, sectors_after = disk_reads(disk)
    served = requests_after - requests
    size = f", requests of {(sectors_after - sectors) * 512 / served / 1e6:.2f} MB" if served > 0 else ""
    return f"{way.__name__} x{processes}: {total / elapsed / 1e6:.0f} MB/s{size}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True,
                        help="the files are made and kept in its corpus/ (on the disk to measure)")
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--mb", type=int, default=10)
    parser.add_argument("--processes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.files, args.mb, args.processes, args.repeat = 4, 1, [2], 1
    directory = args.dir / "corpus"
    make_corpus(directory, Corpus("large", args.files, args.mb * 1000 * 1000))
    paths = [str(p) for p in files_of(directory)]
    disk = disk_of(paths[0])
    print(f"{args.files} files x {args.mb} MB under {directory} (disk {disk}), {os.cpu_count()} cores, cold each try",
          flush=True)
    for _ in range(args.repeat):
        print("; ".join(timed(way, directory, paths, n, disk) for way in (cat, whole, read_through) for n in args.processes),
              flush=True)


if __name__ == "__main__":
    main()
