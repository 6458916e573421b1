"""The Ray backend on GPUs: the DDP example (examples/ddp_quickstart.py's run_train) over a Ray
cluster of --nodes nodes on this one host, one GPU per node (each raylet sees its own GPU alone),
with NCCL; then the same function on this machine alone (the local backend) on as many GPUs. The
losses must be equal at the same seed, and no process of either is left on a GPU afterwards.

    python benchmarks/ray_gpu.py --nodes 2     # a host with two GPUs
    python benchmarks/ray_gpu.py --smoke       # CPU nodes and gloo: proves that it runs
"""

from __future__ import annotations

import os
import sys

# benchmarks/ray.py, beside this file, would shadow Ray.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_quickstart.py"
EPOCHS, BATCH = 3, 64


def example_function():
    """run_train as the example defines it, without the cells that call it."""
    source = EXAMPLE.read_text().split("\n# %%\nresults = ")[0]
    namespace = {"__name__": "ddp_quickstart"}
    exec(compile(source, str(EXAMPLE), "exec"), namespace)
    return namespace["run_train"].__wrapped__


def gpu_processes() -> list[str]:
    found = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True)
    return [line for line in found.stdout.splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes, one GPU each")
    parser.add_argument("--smoke", action="store_true", help="two CPU nodes of one rank each, gloo")
    args = parser.parse_args()
    gpus = not args.smoke

    from ray.cluster_utils import Cluster

    import fanrun

    train = example_function()
    kind = {} if gpus else {"accelerator_type": "CPU"}

    def node(index: int) -> dict:
        # Each raylet sees one GPU, as each machine of a real cluster sees its own.
        if gpus:
            return {"num_cpus": 4, "num_gpus": 1, "env_vars": {"CUDA_VISIBLE_DEVICES": str(index)}}
        return {"num_cpus": 1}

    cluster = Cluster(initialize_head=True, head_node_args={**node(0), "include_dashboard": False})
    try:
        for index in range(1, args.nodes):
            cluster.add_node(**node(index))
        cluster.wait_for_nodes()
        fanrun.ray_init(address=cluster.address)
        started = time.perf_counter()
        on_ray = fanrun.distributed(num_accelerators=args.nodes, nodes=args.nodes, backend="ray", tracking=False,
                                    **kind)(train).distributed(num_epochs=EPOCHS, batch_size=BATCH)
        ray_s = time.perf_counter() - started
    finally:
        fanrun.ray_shutdown()
        cluster.shutdown()
    left_after_ray = gpu_processes() if gpus else []

    started = time.perf_counter()
    local = fanrun.distributed(num_accelerators=args.nodes, backend="local", tracking=False,
                               **kind)(train).distributed(num_epochs=EPOCHS, batch_size=BATCH)
    local_s = time.perf_counter() - started
    left_after_local = gpu_processes() if gpus else []

    print(f"DDP example, {EPOCHS} epochs, {args.nodes} ranks, {'NCCL on GPUs' if gpus else 'gloo on CPUs'}")
    for name, results, seconds in (("ray", on_ray, ray_s), ("local", local, local_s)):
        print(f"  {name:<6} {seconds:6.2f} s")
        for result in results:
            losses = ", ".join(f"{loss:.6f}" for loss in result["losses"])
            print(f"    rank {result['rank']} on {result['device']}: {losses}")
    pairs = [(a, b) for r, l in zip(on_ray, local, strict=True) for a, b in zip(r["losses"], l["losses"], strict=True)]
    exact = all(a == b for a, b in pairs)
    close = all(math.isclose(a, b, rel_tol=1e-6) for a, b in pairs)
    print(f"losses {'equal bit for bit' if exact else 'equal within 1e-6' if close else 'DIFFERENT'}")
    if gpus:
        print(f"GPU processes after the Ray run: {left_after_ray or 'none'}; after the local run: {left_after_local or 'none'}")
    if not close or left_after_ray or left_after_local:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
