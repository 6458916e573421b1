"""Benchmark: distributed checkpoint save and load, VolumeWriter/VolumeReader against DCP's
FileSystemWriter/Reader (1 and 8 threads) and torch.save/torch.load of each rank's part, with
the disk's raw bandwidth (dd with O_DIRECT, and fio with several queues where it is on PATH) as
the limit; and dcp.async_save: how long the caller
is blocked against the device-to-host copy, and whether and when the save completes.

    python benchmarks/checkpoint.py                          # 1 GB over 2 ranks, CPU tensors
    python benchmarks/checkpoint.py --sizes 1 8 --ranks 2 4  # the issue's full set
    python benchmarks/checkpoint.py --device cuda --sizes 8 --ranks 2   # GPU tensors, one GPU a rank
    python benchmarks/checkpoint.py --smoke                  # 20 MB, 2 ranks, one round: that it runs

Cold loads: each file is fsynced and its pages dropped with posix_fadvise(POSIX_FADV_DONTNEED)
before the load (no root needed; dirty pages cannot be dropped, hence the fsync first, outside
the timing). GB is 10^9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("fanrun", "dcp-1", "dcp-8", "torch.save")
PEERS = METHODS[1:]
TENSOR_BYTES = 64 << 20  # each rank's part is cut into tensors of this size (the last one smaller)
GOAL_FRACTION = 0.9


# ---------------------------------------------------------------- what each rank runs


def rank_main(directory: str, total_bytes: int, device: str, repeat: int, async_timeout_s: float) -> None:
    """Every method's save, cold load and warm load on this rank's part (the best of `repeat`
    rounds: the first save of GPU tensors also allocates pinned memory, which later saves reuse),
    then async_save. Results go to a JSON file per rank (a save that never completes must not
    lose them)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # async_save runs DCP's collectives on a CPU backend.
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    expected = make_state(rank, total_bytes // world, "cpu")  # what every load must give back
    state = {key: tensor.to(device, copy=True) for key, tensor in expected.items()}
    results: dict = {"rank": rank, "bytes": total_bytes, "methods": {}}
    out_path = Path(directory, f"results-rank{rank}.json")

    # One small round per method first: DCP's first call in a process pays for imports and
    # set-up that no later save pays again.
    small = {f"rank{rank}.warm": torch.ones(1024, device=device)}
    for method in METHODS:
        target = os.path.join(directory, f"warm-{method}")
        save(method, small, target, rank)
        load(method, small, target, rank)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)

    results["save_rounds"] = {}
    for method in METHODS:
        best = {"save_s": float("inf"), "cold_s": float("inf"), "warm_s": float("inf")}
        rounds = results["save_rounds"][method] = []
        for _ in range(repeat):
            target = os.path.join(directory, f"ckpt-{method}")
            times = {"save_s": timed(lambda: save(method, state, target, rank))}
            drop_page_cache(target)
            times["cold_s"] = timed(lambda: load(method, state, target, rank))
            times["warm_s"] = timed(lambda: load(method, state, target, rank))
            verify(state, expected, rank)
            rounds.append(times["save_s"])
            best = {key: min(best[key], times[key]) for key in best}
            dist.barrier()
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
            dist.barrier()
        results["methods"][method] = best

    results["async"] = {}
    for method in ("fanrun", "dcp-8"):
        for attempt in (1, 2):  # the first fanrun one also allocates the pinned staging memory
            target = os.path.join(directory, f"async-{method}-{attempt}")
            outcome = async_save(method, state, expected, target, async_timeout_s)
            results["async"][f"{method}#{attempt}"] = outcome
            if method == "fanrun" and attempt == 2:
                # Measured after fanrun's async saves, so that their first one finds no pinned
                # memory of this size left in torch's cache by this measurement.
                results["d2h_s"] = host_copy_seconds(state)
            out_path.write_text(json.dumps(results))
            if not outcome["completed"]:
                # Its save thread is stuck in a collective: leave without waiting for it.
                sys.stdout.flush()
                os._exit(0)
    dist.destroy_process_group()


def make_state(rank: int, part_bytes: int, device: str) -> dict:
    import torch

    state, left, index = {}, part_bytes, 0
    generator = torch.Generator().manual_seed(rank)
    while left > 0:
        count = min(TENSOR_BYTES, left) // 4
        tensor = torch.rand(count, generator=generator)
        state[f"rank{rank}.t{index}"] = tensor.to(device)
        left -= count * 4
        index += 1
        if count == 0:
            break
    return state


def timed(operation) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    operation()
    dist.barrier()
    return time.perf_counter() - start


def save(method: str, state: dict, target: str, rank: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from fanrun.data import VolumeWriter

    if method == "fanrun":
        dcp.save(state, storage_writer=VolumeWriter(target))
    elif method.startswith("dcp-"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(target, thread_count=int(method[4:])))
    else:
        os.makedirs(target, exist_ok=True)
        torch.save(state, os.path.join(target, f"rank{rank}.pt"))  # no fsync, as torch.save does


def load(method: str, state: dict, target: str, rank: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from fanrun.data import VolumeReader

    for tensor in state.values():
        tensor.zero_()  # so that verify() proves the load
    if method == "fanrun":
        dcp.load(state, storage_reader=VolumeReader(target))
    elif method.startswith("dcp-"):
        dcp.load(state, storage_reader=dcp.FileSystemReader(target))
    else:
        loaded = torch.load(os.path.join(target, f"rank{rank}.pt"), map_location="cpu", weights_only=True)
        for key, tensor in state.items():
            tensor.copy_(loaded[key])


def verify(state: dict, expected: dict, rank: int) -> None:
    for key, tensor in state.items():
        if not tensor.cpu().equal(expected[key]):
            raise RuntimeError(f"rank {rank}: {key} did not load back as saved")


def drop_page_cache(target: str) -> None:
    """fsync then POSIX_FADV_DONTNEED every file of this checkpoint: a cold cache without root."""
    import torch.distributed as dist

    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        for path in Path(target).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()


def host_copy_seconds(state: dict) -> float:
    """The device-to-host copy of the whole part into pinned memory (CPU: a memcpy), warm."""
    import torch

    on_gpu = next(iter(state.values())).is_cuda
    hosts = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=on_gpu) for k, v in state.items()}
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for key, tensor in state.items():
            hosts[key].copy_(tensor, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def async_save(method: str, state: dict, expected: dict, target: str, timeout_s: float) -> dict:
    """One dcp.async_save; right after it returns, every tensor is changed in place (queued on
    the same stream, as a training step would be). Once the save completes, it is loaded back
    and must hold the values of the moment of the call."""
    import concurrent.futures

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fanrun.data import VolumeWriter

    writer = VolumeWriter(target) if method == "fanrun" else dcp.FileSystemWriter(target, thread_count=8)
    dist.barrier()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    response = dcp.async_save(state, storage_writer=writer)
    blocked = time.perf_counter() - start
    with torch.no_grad():
        for tensor in state.values():
            tensor.add_(1.0)
    future = getattr(response, "upload_completion", response)
    try:
        future.result(timeout=timeout_s)
        completed, total = True, time.perf_counter() - start
    except concurrent.futures.TimeoutError:
        return {"blocked_s": blocked, "completed": False, "complete_s": None, "verified": False}
    load(method if method == "fanrun" else "dcp-8", state, target, int(os.environ["RANK"]))
    verify(state, expected, int(os.environ["RANK"]))
    return {"blocked_s": blocked, "completed": completed, "complete_s": total, "verified": True}


# ---------------------------------------------------------------- the caller


def raw_disk(directory: str, size_bytes: int) -> tuple[float, float]:
    """dd with O_DIRECT: write (with a final fsync) and read GB/s of the disk under directory."""
    path = os.path.join(directory, "dd.bin")
    block = 16 << 20
    count = max(1, size_bytes // block)
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct", "conv=fsync"],
        check=True, capture_output=True,
    )
    write = count * block / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct"], check=True, capture_output=True)
    read = count * block / (time.perf_counter() - start) / 1e9
    os.unlink(path)
    return write, read


FIO_JOBS = 4  # queues: fio's jobs, each with requests of FIO_BLOCK in flight
FIO_BLOCK = "4M"


def fio_disk(directory: str, size_bytes: int) -> tuple[float, float] | None:
    """fio with O_DIRECT, FIO_JOBS jobs, a final fsync on writes: write and read GB/s of the disk
    under directory, a stronger limit than one dd stream. None where fio is not on PATH. Tries
    io_uring with 16 requests in flight per job, then plain pread/pwrite (psync) where the
    kernel refuses io_uring."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    per_job = max(1 << 20, size_bytes // FIO_JOBS)
    rates = []
    for rw in ("write", "read"):
        for engine in ("io_uring", "psync"):
            command = [fio, "--name=disk", f"--directory={directory}", "--filename_format=fanrun-fio.$jobnum",
                       f"--rw={rw}", f"--bs={FIO_BLOCK}", f"--size={per_job}", f"--numjobs={FIO_JOBS}",
                       f"--ioengine={engine}", "--iodepth=16", "--direct=1", "--end_fsync=1", "--group_reporting",
                       "--output-format=json"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode == 0:
                job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0][rw]
                rates.append(job["bw_bytes"] / 1e9)
                break
        else:
            print(f"fio {rw} failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
            rates.append(0.0)
    for job in range(FIO_JOBS):
        Path(directory, f"fanrun-fio.{job}").unlink(missing_ok=True)
    return rates[0], rates[1]


def decorator_arguments(ranks: int, device: str) -> dict:
    """@distributed's arguments for one case: one rank per GPU, of the GPUs fanrun finds, or
    CPU processes even where there are GPUs."""
    return {"num_accelerators": ranks, "accelerator_type": None if device == "cuda" else "CPU"}


def run_case(size_gb: float, ranks: int, device: str, base: str, repeat: int, async_timeout_s: float) -> dict:
    from fanrun import distributed

    directory = tempfile.mkdtemp(prefix=f"ckpt-{size_gb}g-{ranks}r-", dir=base)
    try:
        try:
            distributed(**decorator_arguments(ranks, device))(rank_main).distributed(
                directory, int(size_gb * 1e9), device, repeat, async_timeout_s
            )
        except Exception as error:
            # A rank that left early (an async save that never completed) or failed a check: what
            # it measured before is in its results file, and the failure is shown.
            print(f"  ({ranks} ranks, {size_gb:g} GB: {type(error).__name__}: {str(error).splitlines()[0]})",
                  file=sys.stderr)
            if not Path(directory, "results-rank0.json").exists():
                raise
        return json.loads(Path(directory, "results-rank0.json").read_text())
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def gbps(size_bytes: int, seconds: float | None) -> str:
    return "-" if not seconds else f"{size_bytes / seconds / 1e9:.2f}"


def report(cases: list[tuple[float, int, dict]], raw: tuple[float, float], repeat: int,
           fio: tuple[float, float] | None) -> None:
    write_raw, read_raw = raw
    print(f"Raw disk (dd, O_DIRECT, the faster of before and after): write {write_raw:.2f} GB/s, "
          f"read {read_raw:.2f} GB/s")
    if fio is None:
        print("fio is not on PATH: the limit is dd's\n")
    else:
        print(f"Raw disk (fio, O_DIRECT, {FIO_JOBS} jobs of {FIO_BLOCK} requests, 16 in flight each, fsync at the end): "
              f"write {fio[0]:.2f} GB/s, read {fio[1]:.2f} GB/s; the limit is the faster of fio and dd\n")
        write_raw, read_raw = max(write_raw, fio[0]), max(read_raw, fio[1])
    for phase, key in (("Save (durable except torch.save)", "save_s"), ("Load, cold cache", "cold_s"),
                       ("Load, warm cache", "warm_s")):
        header = ["GB", "ranks", *METHODS, *(f"fanrun/{p}" for p in PEERS), "fanrun/raw"]
        rows = []
        for size_gb, ranks, result in cases:
            m = result["methods"]
            row = [f"{size_gb:g}", str(ranks), *(gbps(result["bytes"], m[x][key]) for x in METHODS)]
            row += [f"{m[p][key] / m['fanrun'][key]:.2f}x" for p in PEERS]
            limit = write_raw if key == "save_s" else read_raw
            row.append(f"{result['bytes'] / m['fanrun'][key] / 1e9 / limit:.0%}")
            rows.append(row)
        print_table(f"{phase}, GB/s, best of {repeat} (ratios: fanrun's speed over the peer's)", header, rows)
    # The best round hides what only a process's first save pays (pinned memory for GPU tensors).
    for size_gb, ranks, result in cases:
        rounds = result.get("save_rounds", {}).get("fanrun", [])
        print(f"fanrun's save of {size_gb:g} GB over {ranks} ranks, each round: "
              + ", ".join(f"{gbps(result['bytes'], s)} GB/s ({s:.3f} s)" for s in rounds))
    print()
    header = ["GB", "ranks", "D2H copy s", "writer", "blocked s (1st)", "done s (1st)",
              "blocked s (2nd)", "done s (2nd)", "blocked/D2H (2nd)"]
    rows = []
    for size_gb, ranks, result in cases:
        for method in ("fanrun", "dcp-8"):
            first, second = (result["async"].get(f"{method}#{i}") for i in (1, 2))
            cells = []
            for outcome in (first, second):
                if outcome is None:
                    cells += ["-", "-"]
                else:
                    cells += [f"{outcome['blocked_s']:.3f}",
                              f"{outcome['complete_s']:.2f}" if outcome["completed"] else "NOT DONE"]
            d2h = result.get("d2h_s")
            ratio = f"{second['blocked_s'] / d2h:.1f}x" if second and d2h else "-"
            rows.append([f"{size_gb:g}", str(ranks), f"{d2h:.3f}" if d2h else "-",
                         "VolumeWriter" if method == "fanrun" else "FileSystemWriter(8)", *cells, ratio])
    print_table("dcp.async_save: seconds the caller was blocked, and until the save completed (the tensors "
                "are changed right after the call; every completed save is loaded back and checked)", header, rows)
    print("Goals:")
    for size_gb, ranks, result in cases:
        m, label = result["methods"], f"{size_gb:g} GB / {ranks} ranks"
        save_fraction = result["bytes"] / m["fanrun"]["save_s"] / 1e9 / write_raw
        cold_fraction = result["bytes"] / m["fanrun"]["cold_s"] / 1e9 / read_raw
        print(f"  {label}: durable save at >= 90% of raw write: {verdict(save_fraction >= GOAL_FRACTION)} "
              f"({save_fraction:.0%}); cold load at >= 90% of raw read: "
              f"{verdict(cold_fraction >= GOAL_FRACTION)} ({cold_fraction:.0%})")
        second = result["async"].get("fanrun#2")
        if second and result.get("d2h_s"):
            ok = second["completed"] and second["blocked_s"] <= 2 * result["d2h_s"]
            print(f"  {label}: async_save blocks <= 2x the D2H copy and completes: {verdict(ok)} "
                  f"({second['blocked_s']:.3f} s blocked, D2H {result['d2h_s']:.3f} s)")


def verdict(ok: bool) -> str:
    return "holds" if ok else "NOT MET"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    print(title)
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0], help="state dict sizes in GB (default 1)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="rank counts (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dir", default=None, help="where to write (default: the temporary directory)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds per method; the best is shown (default 2)")
    parser.add_argument("--async-timeout", type=float, default=300.0,
                        help="seconds to wait for an async_save before calling it not completed")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.ranks, args.repeat = [0.02], [2], 1
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("FANRUN_TRACKING", "0")

    import torch

    from fanrun import _core

    print(f"Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"device {args.device}, CRC32C in hardware: {_core.crc32c_has_hardware()}, "
          f"directory {args.dir or tempfile.gettempdir()}\n")
    base = args.dir or tempfile.gettempdir()
    raw_size = int(max(args.sizes) * 1e9)
    before = raw_disk(base, raw_size)
    cases = []
    for size_gb in args.sizes:
        for ranks in args.ranks:
            print(f"measuring {size_gb:g} GB over {ranks} ranks ...", file=sys.stderr, flush=True)
            cases.append((size_gb, ranks, run_case(size_gb, ranks, args.device, base, args.repeat, args.async_timeout)))
    after = raw_disk(base, raw_size)
    # The disk measured before and after the cases; the faster of the two is the limit.
    report(cases, (max(before[0], after[0]), max(before[1], after[1])), args.repeat, fio_disk(base, raw_size))


if __name__ == "__main__":
    main()
