"""Training steps per second with MLflow tracking on (every rank logging every step) and off."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

# name: (label, tracking, logging: "no", "import" (mlflow imported, nothing logged) or
# "every step", MLFLOW_ENABLE_ASYNC_LOGGING); None leaves fanrun's default.
MODES = {
    "off": ("off: tracking=False, no logging", False, "no", None),
    "import": ("on: mlflow imported in the ranks, nothing logged", True, "import", None),
    "default": ("on: log_metric every step (fanrun's default)", True, "every step", None),
    "async": ("on: log_metric every step, MLFLOW_ENABLE_ASYNC_LOGGING=true", True, "every step", "true"),
}


def train(steps: int, warmup: int, logging: str, gpu: bool) -> dict:
    """One rank: an MLP trained with DDP, steps/s timed over the loop alone. On the CPU a small
    one over gloo (steps of a few ms: the worst case); on a GPU the model of
    benchmarks/throughput.py over NCCL (steps of tens of ms, as in real training)."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    log = logging == "every step"
    if logging != "no":
        import mlflow
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    if gpu:
        width = 1024
        layers = [torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)) for _ in range(4)]
        model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).cuda())
        inputs, targets = torch.randn(64, 128, width, device="cuda"), torch.randn(64, 128, 1, device="cuda")
    else:
        model = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        )
        inputs, targets = torch.randn(64, 64), torch.randn(64, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(index: int) -> None:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # Every mode reads the loss, as a loop that reports it does: on a GPU .item() waits for
        # the step, which is the loop's cost, not tracking's.
        value = loss.item()
        if log:
            mlflow.log_metric("loss", value, step=index)

    for index in range(warmup):
        step(index)
    dist.barrier()
    start = time.perf_counter()
    for index in range(warmup, warmup + steps):
        step(index)
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    run_id = mlflow.active_run().info.run_id if log else None
    return {"rank": rank, "steps_per_s": steps / elapsed, "run_id": run_id}


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(ranks: int, steps: int, warmup: int, tracking: bool, logging: str, async_logging: str | None, gpu: bool) -> tuple[float, int | None]:
    """Steps/s of the slowest rank, and how many loss points reached the run (None untracked)."""
    from fanrun import distributed, flush_tracking

    # The run's link and the ranks' output go to stderr: stdout holds the report alone.
    with environment(MLFLOW_ENABLE_ASYNC_LOGGING=async_logging), contextlib.redirect_stdout(sys.stderr):
        # Without --gpu, CPU processes with gloo on any machine, GPUs or not.
        launch = distributed(num_accelerators=ranks, accelerator_type=None if gpu else "CPU", tracking=tracking)
        results = launch(train).distributed(steps, warmup, logging, gpu)
        # The run is closed, its last values written, moments after the call returns.
        flush_tracking()
    points = None
    if tracking and logging == "every step":
        import mlflow

        run_id = results[0]["run_id"]
        points = len(mlflow.MlflowClient().get_metric_history(run_id, "loss"))
    return min(r["steps_per_s"] for r in results), points


def machine() -> str:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = ", ".join(f"{name} {version(name)}" for name in ("fanrun", "torch", "mlflow"))
    return (
        f"{cpu}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {platform.platform()}, "
        f"Python {platform.python_version()}, {versions}; load {os.getloadavg()[0]:.2f} at the start"
    )


def version(name: str) -> str:
    for distribution in (name, f"{name}-skinny"):  # MLflow also ships as mlflow-skinny
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500, help="timed steps per call")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (DDP buckets, first batches)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="train on the GPUs with NCCL (--ranks: at most the GPUs)")
    parser.add_argument("--tracking-uri", default=None,
                        help="where runs go (default: a sqlite store in a temporary folder, MLflow's local default)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="which modes to run ('off' is always run: the others are measured against it)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    options = parser.parse_args()
    if options.smoke:
        options.ranks, options.steps, options.warmup, options.repeats = 2, 10, 1, 1
    modes = [MODES[name] for name in MODES if name == "off" or name in options.modes]

    with tempfile.TemporaryDirectory(prefix="fanrun-tracking-bench-") as scratch:
        uri = options.tracking_uri or f"sqlite:///{scratch}/mlflow.db"
        with environment(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME="fanrun-tracking-benchmark", FANRUN_TRACKING=None):
            os.chdir(scratch)  # MLflow's local artifact folders land here, not in the checkout
            print(f"machine: {machine()}", flush=True)
            where = "NCCL, GPUs" if options.gpu else "gloo, CPU"
            print(f"{options.ranks} ranks ({where}), {options.steps} timed steps after {options.warmup}, "
                  f"{options.repeats} repeats, tracking store {uri.split('://')[0]}", flush=True)
            rates: dict[str, list[float]] = {label: [] for label, *_ in modes}
            points: dict[str, int | None] = {}
            # One call of each mode per round: drift in the machine's load spreads over all modes.
            # Round 0 warms caches and creates the store, and is not counted; a smoke run, whose
            # figures mean nothing, skips it.
            for round_index in range(1 if options.smoke else 0, options.repeats + 1):
                for label, tracking, logging, async_logging in modes:
                    rate, logged = measure(options.ranks, options.steps, options.warmup, tracking, logging, async_logging, options.gpu)
                    if round_index == 0:
                        continue
                    rates[label].append(rate)
                    points[label] = logged
                    print(f"  round {round_index}: {label}: {rate:.1f} steps/s", file=sys.stderr, flush=True)

    baseline = statistics.median(rates[MODES["off"][0]])
    expected = options.ranks * (options.steps + options.warmup)
    print()
    print(f"| mode | steps/s (median of {options.repeats}) | min - max | vs off | loss points on the run |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, *_ in modes:
        median = statistics.median(rates[label])
        logged = points[label]
        shown = "-" if logged is None else f"{logged} of {expected}"
        print(f"| {label} | {median:.1f} | {min(rates[label]):.1f} - {max(rates[label]):.1f} | "
              f"{median / baseline:.2f} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
