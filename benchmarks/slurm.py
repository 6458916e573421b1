"""Benchmark: a whole call over 2 Slurm nodes x 2 gloo ranks, `fanrun run --nodes 2` against
`srun torchrun` for the same script, each inside an allocation of its own that salloc grants:
import torch, join the process group, all-reduce, exit. Goal: fanrun at most 0.8x srun torchrun.

The cluster is the tests' (tests/slurm/cluster.py): slurmctld and two slurmd on this machine, so
the figures say what each launcher costs, not what a network does.

    python tests/ray/netns.py python benchmarks/slurm.py [--calls 5] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "slurm")]  # the tests' cluster

GOAL = 0.8
NODES, PER_NODE = 2, 2
SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
assert value.item() == sum(range(1, dist.get_world_size() + 1)), value
dist.destroy_process_group()
"""


def commands(script: Path, port: int) -> dict[str, list[str]]:
    allocation = ["salloc", f"--nodes={NODES}"]
    return {
        "fanrun": [*allocation, sys.executable, "-m", "fanrun", "run", "--nodes", str(NODES), "-n", str(PER_NODE),
                   str(script)],
        "srun torchrun": [*allocation, "srun", "--ntasks-per-node=1", sys.executable, "-m", "torch.distributed.run",
                          f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}", "--rdzv-backend=c10d",
                          f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench-{port}", str(script)],
    }


def timed(cluster, command: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    done = cluster.run(command, env=env, cwd=cwd, timeout=300)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one call each: that every path still runs")
    args = parser.parse_args()
    calls = 1 if args.smoke else args.calls

    from cluster import LocalSlurm
    from loopback_address import add_second_loopback_address

    add_second_loopback_address()
    work = Path(tempfile.mkdtemp(prefix="fanrun-slurm-bench-"))
    work.chmod(0o711)  # munged needs its socket's folders open to all (the tests' conftest.py)
    (work / "cluster").mkdir()
    cluster = LocalSlurm(work / "cluster")
    cluster.start()
    try:
        script = work / "all_reduce.py"
        script.write_text(SCRIPT)
        env = {**cluster.env, "FANRUN_RUNS_DIR": str(work / "runs"), "FANRUN_TRACKING": "0"}
        times: dict[str, list[float]] = {"fanrun": [], "srun torchrun": []}
        for call in range(calls):
            for name, command in commands(script, 29400 + call).items():  # in turn, so drift hits both
                times[name].append(timed(cluster, command, env, work))
        print(f"Whole call over {NODES} Slurm nodes x {PER_NODE} gloo ranks, each in an allocation of its own "
              f"(salloc), {calls} calls, seconds: median (all)")
        for name, values in times.items():
            print(f"  {name:<14} {statistics.median(values):.3f}  ({', '.join(f'{v:.3f}' for v in values)})")
        ratio = statistics.median(times["fanrun"]) / statistics.median(times["srun torchrun"])
        print("Goals:")
        print(f"  fanrun/srun torchrun <= {GOAL}: {'holds' if ratio <= GOAL else 'NOT MET'} ({ratio:.2f}x)")
    finally:
        left = cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    if left:
        raise SystemExit(f"processes were left: {left}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
