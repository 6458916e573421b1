"""Benchmark: reading one corpus with VolumeDataset, a plain torch Dataset, WebDataset and
MosaicML streaming, N ranks x W DataLoader workers: warm (page cache), cold from the disk
(the files dropped from the page cache first) and cold over HTTP from nginx, against the raw
read bandwidth of the same files from the same places.

Every method reads every byte of every sample in its DataLoader workers and hands back the
sample's length, so that what is timed is the input pipeline, not the transfer of batches to
the main process. Each method runs in a fanrun call of its own, from a barrier in every
rank, and the slowest rank's time is the method's time. Times include building the dataset
and starting the workers. Each cold row is run --cold-tries times, each right after `cat`
read the disk, and shows the try whose rate against that `cat` is the median.

    python benchmarks/data.py                 # a small corpus, a few minutes on 2 cores
    python benchmarks/data.py --full          # 20,000 x 100 KB and 200 x 10 MB
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the nginx the data tests use

PEERS = ("webdataset", "streaming")
GOAL_RATIO = 1.5
GOAL_PLAIN_RATIO = 1.0  # warm: no slower than a plain Dataset opening and reading the same files
GOAL_RAW_FRACTION = 0.9
GOAL_FIRST_BATCH_S = 1.0
COLD_DISK = ", cold disk"  # run after the files were dropped from the page cache
SHARDS = 16  # tar and MDS shards per corpus: at least ranks x workers, so every worker has some


@dataclasses.dataclass
class Corpus:
    name: str
    count: int
    size: int  # bytes per file


# ---------------------------------------------------------------- the corpus and its conversions


def make_corpus(directory: Path, corpus: Corpus) -> None:
    marker = directory / f".complete-{corpus.count}x{corpus.size}"
    if marker.exists():
        return
    shutil.rmtree(directory, ignore_errors=True)
    block = os.urandom(corpus.size)
    for i in range(corpus.count):
        sub = directory / f"d{i % 16:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        header = f"{i:08d}".encode()
        (sub / f"s{i:06d}.bin").write_bytes(header + block[len(header):])
    marker.touch()


def files_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.bin"))


def to_webdataset(files: list[Path], out: Path) -> float:
    import webdataset as wds

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    per_shard = -(-len(files) // SHARDS)
    for shard in range(SHARDS):
        with wds.TarWriter(str(out / f"shard-{shard:03d}.tar")) as sink:
            for i, path in enumerate(files[shard * per_shard:(shard + 1) * per_shard]):
                sink.write({"__key__": f"{shard:03d}{i:06d}", "bin": path.read_bytes()})
    return time.perf_counter() - started


def to_mds(files: list[Path], out: Path) -> float:
    streaming = import_streaming()
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    total = sum(p.stat().st_size for p in files)
    limit = max(1 << 20, total // SHARDS + 1)
    with streaming.MDSWriter(out=str(out), columns={"bin": "bytes"}, size_limit=limit) as writer:
        for path in files:
            writer.write({"bin": path.read_bytes()})
    return time.perf_counter() - started


def import_streaming():
    """MosaicML streaming's package imports its vision datasets, and so torchvision, on import.
    The only torchvision for torch 2.13.0 on the index is a CUDA build that cannot load against
    torch's CPU build; the vision datasets are not used here, so they are left out."""
    import types

    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def evict(*directories: Path) -> None:
    """Drops the files from the page cache (posix_fadvise DONTNEED: no privilege needed), so
    that the next read comes from the disk."""
    for directory in directories:
        for path in directory.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages would stay
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def raw_read(directory: Path, parallel: int, cold: bool) -> float:
    """MB/s of `cat` over every file, by up to `parallel` processes of 64 files each, from the
    disk (cold) or from the page cache: the limits the methods are held to."""
    command = f"find {directory} -name '*.bin' -print0 | xargs -0 -P {parallel} -n 64 cat > /dev/null"
    total = sum(p.stat().st_size for p in files_of(directory))
    if cold:
        evict(directory)
    started = time.perf_counter()
    subprocess.run(command, shell=True, check=True)
    return total / (time.perf_counter() - started) / 1e6


# ---------------------------------------------------------------- what the ranks run


def rank_methods(spec: dict) -> dict:
    """In every rank: each method of spec in turn, from a barrier, over the whole corpus once."""
    import warnings

    import torch.distributed as dist
    import torch.utils.data

    # More workers than cores is what the benchmark asks for on a small machine.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, workers = spec["batch_size"], spec["workers"]

    def read_len(path: str) -> int:
        with open(path, "rb") as file:
            return len(file.read())

    class PlainFiles(torch.utils.data.Dataset):
        def __init__(self, paths):
            self.paths = paths

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, index):
            return read_len(self.paths[index])

    class PlainHttp(PlainFiles):
        def __getitem__(self, index):
            import fsspec

            with fsspec.open(self.paths[index], "rb") as file:
                return len(file.read())

    def volume(source, cache_dir):
        from fanrun.data import DataLoader, VolumeDataset

        ds = VolumeDataset(source, pattern="*.bin", cache_dir=cache_dir, transform=read_len)
        return DataLoader(ds, batch_size=batch, num_workers=workers)

    def plain(paths):
        if isinstance(paths, str):  # a directory, listed as a user of a plain Dataset would
            paths = sorted(str(p) for p in Path(paths).rglob("*.bin"))
        ds = PlainFiles(paths) if not paths[0].startswith("http") else PlainHttp(paths)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True)
        return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers, sampler=sampler)

    def webdataset(urls):
        import webdataset as wds

        ds = wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node,
                            workersplitter=wds.split_by_worker, empty_check=False).map(lambda s: len(s["bin"]))
        return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers)

    def mosaic(local):
        streaming = import_streaming()

        class Lengths(streaming.StreamingDataset):
            def __getitem__(self, index):
                return len(super().__getitem__(index)["bin"])

        ds = Lengths(local=local, shuffle=True, batch_size=batch)
        return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers)

    makers = {
        "volume": lambda: volume(spec["local"], spec["cache"]),
        "volume (http, warm cache)": lambda: volume(spec["url"], spec["cache"]),
        "volume (http, cold)": lambda: volume(spec["url"], spec["cold_cache"]),
        "plain": lambda: plain(spec["local"]),
        "plain (http, cold)": lambda: plain(spec["urls"]),
        "webdataset": lambda: webdataset(spec["tars"]),
        "webdataset (http, cold)": lambda: webdataset(spec["tar_urls"]),
        "streaming": lambda: mosaic(spec["mds"]),
    }
    # Each library is imported before the clock starts: what is timed is reading, not importing.
    imports = {"volume": "fanrun.data", "webdataset": "webdataset", "plain (http": "fsspec.implementations.http",
               "volume (http": "fsspec.implementations.http"}
    for name in spec["methods"]:
        for prefix, module in imports.items():
            if name.startswith(prefix):
                __import__(module)
        if name.startswith("streaming"):
            import_streaming()
    results = {}
    for name in spec["methods"]:
        dist.barrier()
        started = time.perf_counter()
        loader = None
        try:
            loader = makers[name.removesuffix(COLD_DISK)]()
            first = None
            samples = total = 0
            for batch_lengths in loader:
                if first is None:
                    first = time.perf_counter() - started
                samples += len(batch_lengths)
                total += int(sum(batch_lengths))
            elapsed = time.perf_counter() - started
            results[name] = {"first": first, "elapsed": elapsed, "samples": samples, "bytes": total}
        except Exception as error:  # one method failing must not hide the others' figures
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        del loader
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "results": results}


# ---------------------------------------------------------------- the caller


def run_corpus(args, corpus: Corpus, work: Path, server, methods: list[str]) -> tuple[dict, dict]:
    from fanrun import distributed

    directory = work / "corpus" / corpus.name
    make_corpus(directory, corpus)
    files = files_of(directory)
    notes = {}
    if any(m.startswith("webdataset") for m in methods):
        notes["webdataset conversion s"] = to_webdataset(files, work / "wds" / corpus.name)
    if any(m.startswith("streaming") for m in methods):
        try:
            notes["MDS conversion s"] = to_mds(files, work / "mds" / corpus.name)
        except Exception as error:
            notes["MDS conversion s"] = f"failed: {type(error).__name__}: {error}"
            methods = [m for m in methods if not m.startswith("streaming")]
    parallel = args.ranks * args.workers
    notes["raw cold MB/s"] = [raw_read(directory, parallel, cold=True)]  # and one before each cold row
    notes["raw MB/s"] = raw_read(directory, parallel, cold=False)
    relative = [p.relative_to(work) for p in files]
    tars = sorted((work / "wds" / corpus.name).glob("*.tar"))
    cold_cache = work / "cache-cold" / corpus.name / str(time.time_ns())
    base = server.url if server is not None else "http://nginx-not-running"
    spec = {
        "batch_size": args.batch_size, "workers": args.workers, "methods": methods,
        "local": str(directory),
        "url": f"{base}/corpus/{corpus.name}/", "urls": [f"{base}/{p}" for p in relative],
        "cache": str(work / "cache-warm" / corpus.name), "cold_cache": str(cold_cache),
        "tars": [str(t) for t in tars], "tar_urls": [f"{base}/{t.relative_to(work)}" for t in tars],
        "mds": str(work / "mds" / corpus.name),
    }
    # The warm cache for remote reads is filled once, untimed.
    if "volume (http, warm cache)" in methods:
        from fanrun.data import VolumeDataset

        for _ in VolumeDataset(spec["url"], pattern="*.bin", cache_dir=spec["cache"]):
            pass
    # One call per method: no library's threads, processes or shared memory meet another's.
    # CPU ranks: what is measured is the input pipeline, on any host, with or without GPUs.
    launch = distributed(num_accelerators=args.ranks, accelerator_type="CPU", tracking=False)(rank_methods)
    merged = {}
    for name in methods:
        if "cold" not in name:  # the cold disk's rows and the cold http ones
            merged[name] = measured(name, launch.distributed({**spec, "methods": [name]}), notes["raw MB/s"])
            continue
        # This virtual disk's rate drifts by a third between minutes: each cold try is held to
        # the rate `cat` got right before it, and the row is the try with the median ratio.
        tries = []
        for _ in range(args.cold_tries):
            raw = raw_read(directory, parallel, cold=True)
            notes["raw cold MB/s"].append(raw)
            evict(directory, work / "wds" / corpus.name, work / "mds" / corpus.name)
            shutil.rmtree(cold_cache, ignore_errors=True)  # the http rows start from an empty cache each time
            tries.append(measured(name, launch.distributed({**spec, "methods": [name]}), raw))
        ratios = sorted((cell["MB/s"] / cell["raw MB/s"], i) for i, cell in enumerate(tries) if "error" not in cell)
        merged[name] = tries[ratios[(len(ratios) - 1) // 2][1]] if ratios else tries[0]
        merged[name]["ratios"] = [ratio for ratio, _ in ratios]
    shutil.rmtree(work / "cache-cold", ignore_errors=True)
    return merged, notes


def measured(name: str, per_rank: list[dict], raw: float) -> dict:
    """One method's figures from its ranks' results: the slowest rank's time is the method's."""
    ranks = [r["results"][name] for r in per_rank]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"error": errors[0]}
    wall = max(r["elapsed"] for r in ranks)
    samples = sum(r["samples"] for r in ranks)
    total = sum(r["bytes"] for r in ranks)
    return {"samples/s": samples / wall, "MB/s": total / wall / 1e6, "first batch s": max(r["first"] for r in ranks),
            "samples": samples, "raw MB/s": raw}


def render(corpus: Corpus, merged: dict, notes: dict) -> str:
    header = ["method", "samples/s", "MB/s", "first batch s", "samples", "vs raw"]
    rows = []
    for name, cell in merged.items():
        if "error" in cell:
            rows.append([name, "error", cell["error"][:80], "", "", ""])
            continue
        raw = cell["raw MB/s"]
        rows.append([name, f"{cell['samples/s']:.0f}", f"{cell['MB/s']:.0f}", f"{cell['first batch s']:.2f}",
                     str(cell["samples"]), f"{cell['MB/s'] / raw:.0%}"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"Corpus {corpus.name}: {corpus.count} files x {corpus.size / 1e6:g} MB"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, [("-" * w) for w in widths], *rows]]
    spreads = [f"{name} {', '.join(f'{r:.0%}' for r in cell['ratios'])}" for name, cell in merged.items()
               if len(cell.get("ratios", [])) > 1]
    if spreads:
        lines.append("cold rows: the try with the median 'vs raw' of " + "; ".join(spreads))
    cold = notes["raw cold MB/s"]
    cats = min(notes["parallel"], -(-corpus.count // 64))  # xargs gives each cat 64 files
    lines.append(f"raw read (cat, {cats} process{'es' if cats > 1 else ''}): {notes['raw MB/s']:.0f} MB/s from the page cache, "
                 f"{min(cold):.0f}-{max(cold):.0f} MB/s from the disk in {len(cold)} reads (each cold row's "
                 f"'vs raw' is against the read right before it); "
                 + "; ".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in notes.items()
                             if k not in ("raw MB/s", "raw cold MB/s", "parallel")))
    return "\n".join(lines)


def goals(corpus: Corpus, merged: dict, notes: dict) -> list[str]:
    out = []
    for suffix, where in (("", "warm"), (COLD_DISK, "cold disk")):
        ours = merged.get("volume" + suffix)
        if not ours or "error" in ours:
            out.append(f"{corpus.name}, {where}: VolumeDataset did not run")
            continue
        plain = merged.get("plain" + suffix)
        if not suffix and plain and "error" not in plain:
            ratio = ours["samples/s"] / plain["samples/s"]
            out.append(f"{corpus.name}, {where}: VolumeDataset >= {GOAL_PLAIN_RATIO}x a plain Dataset [goal]: "
                       f"{'holds' if ratio >= GOAL_PLAIN_RATIO else 'NOT MET'} ({ratio:.2f}x)")
        for peer in PEERS:
            theirs = merged.get(peer + suffix)
            if not theirs or "error" in theirs:
                out.append(f"{corpus.name}, {where}: VolumeDataset >= {GOAL_RATIO}x {peer}: n/a ({peer} did not run)")
                continue
            ratio = ours["samples/s"] / theirs["samples/s"]
            goal = "" if suffix else " [goal]"
            out.append(f"{corpus.name}, {where}: VolumeDataset >= {GOAL_RATIO}x {peer}{goal}: "
                       f"{'holds' if ratio >= GOAL_RATIO else 'NOT MET'} ({ratio:.2f}x)")
        fraction = ours["MB/s"] / ours["raw MB/s"]
        if suffix:
            out.append(f"{corpus.name}, {where}: VolumeDataset >= {GOAL_RAW_FRACTION:.0%} of the disk's raw read "
                       f"bandwidth [goal]: {'holds' if fraction >= GOAL_RAW_FRACTION else 'NOT MET'} ({fraction:.0%})")
        else:
            # The disk's bandwidth is no limit to reads from the page cache; `cat` copying
            # the cached files into one reused buffer is the ceiling shown here.
            out.append(f"{corpus.name}, {where}: VolumeDataset against cat from the page cache: {fraction:.0%}; "
                       f"against the disk's raw bandwidth: {ours['MB/s'] / max(notes['raw cold MB/s']):.0%}")
        first = ours["first batch s"]
        out.append(f"{corpus.name}, {where}: VolumeDataset first batch within {GOAL_FIRST_BATCH_S:g} s [goal]: "
                   f"{'holds' if first <= GOAL_FIRST_BATCH_S else 'NOT MET'} ({first:.2f} s)")
    remote = merged.get("volume (http, cold)")
    if remote and "error" not in remote:
        first = remote["first batch s"]
        out.append(f"{corpus.name}, http, cold: VolumeDataset first batch within {GOAL_FIRST_BATCH_S:g} s [goal]: "
                   f"{'holds' if first <= GOAL_FIRST_BATCH_S else 'NOT MET'} ({first:.2f} s)")
    return out


LOCAL_METHODS = ["volume", "plain", "webdataset", "streaming"]
ALL_METHODS = [*LOCAL_METHODS, "volume (http, warm cache)", *(m + COLD_DISK for m in LOCAL_METHODS),
               "volume (http, cold)", "plain (http, cold)", "webdataset (http, cold)"]


def usable(methods: list[str]) -> tuple[list[str], list[str]]:
    """The methods this machine can run, and why the others cannot."""
    from nginx_server import nginx_binary

    import torch

    # Without the pin, pip may replace the installed torch to match a newer torchvision.
    install = f"pip install webdataset mosaicml-streaming torch=={torch.__version__.split('+')[0]}"
    reasons = {}
    if nginx_binary() is None:
        reasons["http"] = "nginx is not installed (Debian's nginx-light; `make test-python` installs it)"
    try:
        import webdataset  # noqa: F401
    except ImportError as error:
        reasons["webdataset"] = f"webdataset cannot be imported ({error}); {install}"
    try:
        import_streaming()
    except Exception as error:
        reasons["streaming"] = f"MosaicML streaming cannot be imported ({type(error).__name__}: {error}); {install}"
    kept, skipped = [], []
    for name in methods:
        why = next((reason for key, reason in reasons.items() if key in name), None)
        (skipped.append(f"{name}: {why}") if why else kept.append(name))
    return kept, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the issue's corpus: 20,000 x 100 KB and 200 x 10 MB")
    parser.add_argument("--small-files", type=int, default=2000)
    parser.add_argument("--small-kb", type=int, default=100)
    parser.add_argument("--large-files", type=int, default=20)
    parser.add_argument("--large-mb", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cold-tries", type=int, default=3,
                        help="runs of each cold row, each after its own cat of the disk; the median one is shown")
    parser.add_argument("--methods", nargs="+", default=ALL_METHODS, choices=ALL_METHODS)
    parser.add_argument("--corpora", nargs="+", default=["small", "large"], choices=["small", "large"])
    parser.add_argument("--dir", type=Path, help="keep the corpus here between runs (default: a temporary folder, removed)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.small_files, args.small_kb, args.large_files, args.large_mb = 24, 4, 4, 1
        args.workers, args.batch_size, args.cold_tries = 1, 4, 1
    if args.full:
        args.small_files, args.small_kb, args.large_files, args.large_mb = 20000, 100, 200, 10
    corpora = [Corpus("small", args.small_files, args.small_kb * 1000), Corpus("large", args.large_files, args.large_mb * 1000 * 1000)]
    if args.smoke:
        corpora = corpora[:1]  # the large corpus takes the same paths through this script
    else:
        corpora = [corpus for corpus in corpora if corpus.name in args.corpora]
    os.environ.setdefault("FANRUN_TRACKING", "0")

    from nginx_server import NginxServer

    methods, skipped = usable(list(args.methods))
    work = args.dir or Path(tempfile.mkdtemp(prefix="fanrun-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "nginx").mkdir(exist_ok=True)
    server = NginxServer(work, work / "nginx") if any("http" in m for m in methods) else None
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.ranks} ranks x {args.workers} workers, batch {args.batch_size}; work dir {work}", flush=True)
    for line in skipped:
        print(f"not run: {line}", flush=True)
    try:
        report = []
        for corpus in corpora:
            merged, notes = run_corpus(args, corpus, work, server, methods)
            notes["parallel"] = args.ranks * args.workers
            report.append((corpus, merged, notes))
            print(render(corpus, merged, notes) + "\n", flush=True)
        print("Goals (warm: the files in the page cache, or in the node's cache for http; cold disk: dropped from the "
              "page cache first; http, cold: over HTTP from nginx on 127.0.0.1, an empty cache, the server's files "
              "dropped from the page cache):")
        for corpus, merged, notes in report:
            for line in goals(corpus, merged, notes):
                print("  " + line)
    finally:
        if server is not None:
            server.stop()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
