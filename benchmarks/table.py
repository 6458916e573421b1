"""Benchmark: one Parquet table's rows in batches, N ranks x W DataLoader workers, with
TableDataset against plain pyarrow iteration, Hugging Face `datasets` (Parquet, streaming),
MosaicML streaming (MDS written from the same table) and Ray Data
(`read_parquet(...).iter_torch_batches`): rows per second warm (page cache) and cold (the files
dropped from the page cache first), against the raw read of the same files (`dd` with O_DIRECT,
and `cat`), and the time to the first batch. A `ready-batches` row gives the ceiling of any
reader behind a DataLoader: fanrun.data.DataLoader handing over batches that are never read.

Every method yields batches of --batch rows: the numeric columns as tensors, the string
column as a list. The ranks' methods run in a fanrun call of their own, from a barrier in every
rank; the slowest rank's time is the method's. Ray Data runs in the caller as its users run
it: one consumer, its reads spread by Ray over ranks x workers CPUs. Times include building the
dataset and starting the workers.

    python benchmarks/table.py                 # 1 M rows
    python benchmarks/table.py --rows 10000000 # the issue's table
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This folder, which Python puts first on sys.path for a script, holds a ray.py: Ray is the package.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(os.path.abspath(__file__))]


def _data_benchmark():
    """benchmarks/data.py, by path: this folder is not on sys.path (above)."""
    import importlib.util

    import cloudpickle

    spec = importlib.util.spec_from_file_location("data_benchmark", Path(__file__).with_name("data.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the ranks cannot import it by name
    return module


_DATA = _data_benchmark()
evict, import_streaming = _DATA.evict, _DATA.import_streaming

GOAL_RATIO = 1.5
GOAL_RAW_FRACTION = 0.9
GOAL_NUMERIC_FRACTION = 0.5  # a table of numeric columns, format="torch", cold
GOAL_FIRST_BATCH_S = 1.0
PEERS = ("pyarrow", "hf-datasets", "streaming", "ray-data")
# Not a reader: the rate at which fanrun.data.DataLoader hands over batches that are never read,
# the ceiling of any reader that feeds a rank through a DataLoader.
CEILING = "ready-batches"
FILES = 16  # at least ranks x workers, so that every peer's worker has files of its own


def make_table(directory: Path, rows: int, numeric: bool) -> None:
    import numpy
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // FILES)
    rng = numpy.random.default_rng(0)
    for index in range(FILES):
        first, count = index * per_file, max(0, min(per_file, rows - index * per_file))
        ids = numpy.arange(first, first + count, dtype=numpy.int64)
        columns = {
            "id": ids,
            "x": rng.random(count, dtype=numpy.float32),
            "y": rng.random(count, dtype=numpy.float32),
            "label": (ids % 10).astype(numpy.int32),
        }
        if not numeric:
            columns["text"] = pa.array([f"row {i} of the table" for i in ids.tolist()])
        table = pa.table(columns)
        pq.write_table(table, directory / f"part-{index:03d}.parquet", row_group_size=65536)


def to_mds(table: Path, out: Path) -> float:
    import pyarrow.dataset as ds

    streaming = import_streaming()
    started = time.perf_counter()
    columns = {"id": "int64", "x": "float32", "y": "float32", "label": "int32", "text": "str"}
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit=1 << 26) as writer:
        for batch in ds.dataset(table).to_batches():
            for row in batch.to_pylist():
                writer.write(row)
    return time.perf_counter() - started


def table_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.parquet"))


def direct_read(directory: Path, parallel: int) -> float | None:
    """MB/s of `dd` with O_DIRECT over every file of the table, `parallel` at a time: the disk
    itself, where a virtual machine's cold `cat` may come from its host's cache. None where the
    filesystem refuses O_DIRECT (tmpfs)."""
    total = table_bytes(directory)
    started = time.perf_counter()
    done = subprocess.run(f"ls {directory}/*.parquet | xargs -P {parallel} -I FILE dd if=FILE of=/dev/null bs=4M iflag=direct",
                          shell=True, capture_output=True)
    return total / (time.perf_counter() - started) / 1e6 if done.returncode == 0 else None


def raw_read(directory: Path, parallel: int, cold: bool) -> float:
    """MB/s of `cat` over every file of the table, `parallel` at a time."""
    total = table_bytes(directory)
    if cold:
        evict(directory)
    started = time.perf_counter()
    subprocess.run(f"ls {directory}/*.parquet | xargs -P {parallel} -n 1 cat > /dev/null", shell=True, check=True)
    return total / (time.perf_counter() - started) / 1e6


# ---------------------------------------------------------------- what the ranks run


def rank_methods(spec: dict) -> dict:
    """In every rank: the method of spec, from a barrier, over the whole table once."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.utils.data

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # Arrow's, only read
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, workers, name = spec["batch"], spec["workers"], spec["method"]
    numeric = ("id", "x", "y", "label")

    def tensors(record_batch) -> dict:
        out = {c: torch.from_numpy(record_batch.column(c).to_numpy()) for c in numeric}
        if not spec["numeric"]:
            out["text"] = record_batch.column("text").to_pylist()
        return out

    class PyarrowFiles(torch.utils.data.IterableDataset):
        """Plain pyarrow: each worker iterates the batches of its own files."""

        def __iter__(self):
            import pyarrow.dataset as ds

            info = torch.utils.data.get_worker_info()
            readers = world * (info.num_workers if info else 1)
            me = rank * (info.num_workers if info else 1) + (info.id if info else 0)
            files = spec["files"][me::readers]
            for record_batch in ds.dataset(files, format="parquet").to_batches(batch_size=batch):
                yield tensors(record_batch)

    class ReadyBatches(torch.utils.data.IterableDataset):
        """One batch of the table, made before the clock starts, yielded as many times as the
        worker's share of the table has batches: nothing is read while the clock runs."""

        def __init__(self, ready: dict) -> None:
            self.ready = ready

        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            readers = world * (info.num_workers if info else 1)
            for _ in range(-(-spec["rows"] // batch) // readers):
                yield dict(self.ready)

    def make():
        if name == "fanrun":
            from fanrun.data import DataLoader, TableDataset

            return DataLoader(TableDataset(spec["table"], format="torch", batch_rows=batch), batch_size=None,
                              num_workers=workers)
        if name == CEILING:
            from fanrun.data import DataLoader

            return DataLoader(ReadyBatches(ready), batch_size=None, num_workers=workers)
        if name == "pyarrow":
            return torch.utils.data.DataLoader(PyarrowFiles(), batch_size=None, num_workers=workers)
        if name == "hf-datasets":
            from datasets import load_dataset
            from datasets.distributed import split_dataset_by_node

            # Its fastest way to batches: batched in the workers, numeric columns as tensors.
            rows = load_dataset("parquet", data_files=spec["files"], split="train", streaming=True)
            rows = split_dataset_by_node(rows, rank=rank, world_size=world).batch(batch_size=batch).with_format("torch")
            return torch.utils.data.DataLoader(rows, batch_size=None, num_workers=workers)
        streaming = import_streaming()
        rows = streaming.StreamingDataset(local=spec["mds"], shuffle=False, batch_size=batch)
        return torch.utils.data.DataLoader(rows, batch_size=batch, num_workers=workers)

    # Each library is imported before the clock starts: what is timed is reading, not importing.
    if name == CEILING:
        import pyarrow.parquet as pq

        ready = tensors(next(pq.ParquetFile(spec["files"][0]).iter_batches(batch_size=batch)))
    if name == "streaming":
        import_streaming()
    else:
        # TableDataset reads with pyarrow.dataset (which imports pandas): imported here too.
        for module in {"fanrun": ["fanrun.data", "pyarrow.dataset"], CEILING: ["fanrun.data"], "pyarrow": ["pyarrow.dataset"],
                       "hf-datasets": ["datasets"]}[name]:
            __import__(module)
    dist.barrier()
    started = time.perf_counter()
    first, count = None, 0
    try:
        for item in make():
            if first is None:
                first = time.perf_counter() - started
            count += len(item["id"])
        result = {"first": first, "elapsed": time.perf_counter() - started, "rows": count}
    except Exception as error:  # one method failing must not hide the others' figures
        result = {"error": f"{type(error).__name__}: {error}"}
    dist.destroy_process_group()
    return result


def ray_data(spec: dict) -> dict:
    """Ray Data in the caller: read_parquet, iter_torch_batches; Ray spreads the reads."""
    import ray

    import torch

    import ray.data  # noqa: F401 - before the clock, as the ranks' libraries

    ray.init(num_cpus=spec["ranks"] * spec["workers"], include_dashboard=False, log_to_driver=False)
    try:
        started = time.perf_counter()
        first, count = None, 0

        def collate(columns: dict) -> dict:
            out = {c: torch.from_numpy(columns[c]) for c in ("id", "x", "y", "label")}
            out["text"] = columns["text"].tolist()
            return out

        rows = ray.data.read_parquet(spec["table"])
        for item in rows.iter_torch_batches(batch_size=spec["batch"], collate_fn=collate):
            if first is None:
                first = time.perf_counter() - started
            count += len(item["id"])
        return {"first": first, "elapsed": time.perf_counter() - started, "rows": count}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- the caller


def measure(name: str, spec: dict, launch) -> dict:
    if name == "ray-data":
        return ray_data(spec)
    per_rank = launch.distributed({**spec, "method": name})
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return {"error": errors[0]}
    return {"first": max(r["first"] for r in per_rank), "elapsed": max(r["elapsed"] for r in per_rank),
            "rows": sum(r["rows"] for r in per_rank)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--methods", nargs="+", default=["fanrun", CEILING, *PEERS], choices=["fanrun", CEILING, *PEERS])
    parser.add_argument("--numeric", action="store_true", help="numeric columns only: no text column")
    parser.add_argument("--dir", type=Path, help="keep the table here between runs (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="a tiny table, one worker: every path runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.workers, args.batch = 20_000, 1, 256
    os.environ.setdefault("FANRUN_TRACKING", "0")
    from fanrun import distributed

    work = args.dir or Path(tempfile.mkdtemp(prefix="fanrun-table-bench-"))
    table, mds = work / ("table-numeric" if args.numeric else "table"), work / ("mds-numeric" if args.numeric else "mds")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.rows} rows, {args.ranks} ranks x {args.workers} workers, batches of {args.batch} rows", flush=True)
    try:
        if not table.exists():
            make_table(table, args.rows, args.numeric)
        notes = {"table MB": table_bytes(table) / 1e6}
        if "streaming" in args.methods and not mds.exists():
            notes["MDS conversion s"] = to_mds(table, mds)
        spec = {"table": str(table), "files": sorted(str(p) for p in table.glob("*.parquet")), "mds": str(mds),
                "batch": args.batch, "workers": args.workers, "ranks": args.ranks, "rows": args.rows,
                "numeric": args.numeric}
        # CPU ranks, also on a GPU machine: reading is what is measured.
        launch = distributed(num_accelerators=args.ranks, accelerator_type="CPU", tracking=False)(rank_methods)
        parallel = args.ranks * args.workers
        results = {}
        print(HEADER, flush=True)
        for name in args.methods:
            if not args.smoke:
                measure(name, spec, launch)  # once untimed: the files in the page cache, imports done
            results[name] = measure(name, spec, launch)
            print(row(name, results[name], notes, args.rows), flush=True)
            # The ceiling reads nothing, so has no cold run; the cold path is the same for every
            # method, and a smoke run takes it once to keep it alive.
            if (args.smoke and name != "fanrun") or name == CEILING:
                continue
            raw = raw_read(table, parallel, cold=True)
            evict(table, mds)
            results[name + ", cold"] = {**measure(name, spec, launch), "raw cold MB/s": raw}
            print(row(name + ", cold", results[name + ", cold"], notes, args.rows), flush=True)
        notes["raw MB/s (page cache)"] = raw_read(table, parallel, cold=False)
        evict(table)
        notes["raw MB/s (O_DIRECT)"] = direct_read(table, parallel)
        print("; ".join(f"{k}: {'n/a' if v is None else f'{v:.1f}'}" for k, v in notes.items()), flush=True)
        print("Goals:")
        for line in goals(results, notes, args.rows, args.numeric):
            print("  " + line)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


HEADER = f"{'method':<22} {'rows/s':>12} {'MB/s':>8} {'first batch s':>14} {'rows':>10}"


def row(name: str, cell: dict, notes: dict, rows: int) -> str:
    if "error" in cell:
        return f"{name:<22} error: {cell['error'][:100]}"
    rate = cell["rows"] / cell["elapsed"]
    megabytes = notes["table MB"] * cell["rows"] / rows / cell["elapsed"]
    return f"{name:<22} {rate:>12,.0f} {megabytes:>8.0f} {cell['first']:>14.2f} {cell['rows']:>10}"


def goals(results: dict, notes: dict, rows: int, numeric: bool = False) -> list[str]:
    ours = results.get("fanrun")
    if not ours or "error" in ours:
        return ["TableDataset did not run"]
    out = []
    rate = ours["rows"] / ours["elapsed"]
    peers = {name: cell["rows"] / cell["elapsed"] for name, cell in results.items()
             if name in PEERS and "error" not in cell}
    if peers:
        best = max(peers, key=peers.get)
        ratio = rate / peers[best]
        out.append(f"warm: TableDataset >= {GOAL_RATIO}x the best peer ({best}): "
                   f"{'holds' if ratio >= GOAL_RATIO else 'NOT MET'} ({ratio:.2f}x)")
    cold = results.get("fanrun, cold")
    if cold and "error" not in cold:
        # The disk is dd's O_DIRECT read where the filesystem allows it, else cat's after eviction.
        disk = notes.get("raw MB/s (O_DIRECT)") or cold["raw cold MB/s"]
        fraction = notes["table MB"] / cold["elapsed"] / disk
        out.append(f"cold: TableDataset >= {GOAL_RAW_FRACTION:.0%} of the disk's raw read rate: "
                   f"{'holds' if fraction >= GOAL_RAW_FRACTION else 'NOT MET'} ({fraction:.0%} of {disk:,.0f} MB/s)")
        if numeric:
            out.append(f"cold, numeric columns: TableDataset >= {GOAL_NUMERIC_FRACTION:.0%} of the disk's O_DIRECT read "
                       f"rate [goal]: {'holds' if fraction >= GOAL_NUMERIC_FRACTION else 'NOT MET'} "
                       f"({notes['table MB'] / cold['elapsed']:,.0f} MB/s, "
                       f"{cold['rows'] / cold['elapsed']:,.0f} rows/s)")
        ceiling = results.get(CEILING)
        if ceiling and "error" not in ceiling:
            needed = GOAL_RAW_FRACTION * disk / notes["table MB"] * rows
            out.append(f"  that rate is {needed:,.0f} rows/s; fanrun.data.DataLoader alone hands a rank's process "
                       f"{ceiling['rows'] / ceiling['elapsed']:,.0f} rows/s of batches it never reads")
    out.append(f"first batch within {GOAL_FIRST_BATCH_S:g} s: {'holds' if ours['first'] <= GOAL_FIRST_BATCH_S else 'NOT MET'} "
               f"({ours['first']:.2f} s)")
    return out


if __name__ == "__main__":
    main()
