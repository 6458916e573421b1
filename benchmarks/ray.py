"""Benchmark: fanrun on Ray against Ray Train's TorchTrainer, on the same local Ray cluster of two
CPU nodes, two gloo ranks on each:
  - a whole call: import torch, join the process group, all-reduce, return (goal: at most 0.7x
    TorchTrainer.fit);
  - failure latency: from a rank's raise on node 1 to the caller's exception (goal: at most 1 s);
  - training throughput of the same DDP loop inside the ranks (goal: 1.00 +/- 0.02).

    python benchmarks/ray.py [--calls 5] [--steps 300] [--smoke]

Run it in a network namespace of its own (python tests/ray/netns.py python benchmarks/ray.py),
so that the cluster binds to loopback alone.
"""

from __future__ import annotations

import os
import sys

# This file is named like the package it measures: its folder must not shadow Ray.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

NODES = 2
RANKS_PER_NODE = 2
WORLD = NODES * RANKS_PER_NODE
CALL_GOAL = 0.7
FAILURE_GOAL_S = 1.0
THROUGHPUT_TOLERANCE = 0.02
FAILING_RANK = 2  # on node 1
# Ray's daemons and workers end within a few seconds of its cluster's shutdown on a loaded machine.
SHUTDOWN_GRACE_S = 15.0


# ---------------------------------------------------------------- what the ranks run


def all_reduce_once() -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def raise_on_one_rank() -> None:
    rank = int(os.environ.get("RANK", "-1"))
    if rank < 0:  # Ray Train sets its own context, not always RANK
        import ray.train

        rank = ray.train.get_context().get_world_rank()
    if rank == FAILING_RANK:
        raise ValueError(f"raised at {time.time()!r}")
    time.sleep(60)


def train_steps(steps: int) -> float:
    """Seconds per step of a small DDP model, after a warm-up, as rank 0 sees it."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 256)
    warmup = max(1, steps // 10)
    for step in range(steps + warmup):
        if step == warmup:
            dist.barrier()
            started = time.perf_counter()
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()
    dist.barrier()
    return (time.perf_counter() - started) / steps


# ---------------------------------------------------------------- the two ways of running them


def fanrun_call(work, *args):
    """Rank 0's value, as TorchTrainer's result gives it."""
    import fanrun

    options = dict(num_accelerators=WORLD, nodes=NODES, accelerator_type="CPU", tracking=False)
    return fanrun.distributed(**options)(work).distributed(*args)[0]


def ray_train_call(work, *args, storage: str):
    import ray.train
    from ray.train.torch import TorchTrainer

    # Rank 0's value comes back through a file: TorchTrainer hands back reported metrics, not values.
    answer = os.path.join(storage, f"value-{time.time_ns()}")

    def loop(config):
        value = work(*config["args"])
        if ray.train.get_context().get_world_rank() == 0:
            with open(answer, "w") as file:
                file.write(repr(value))

    trainer = TorchTrainer(
        loop,
        train_loop_config={"args": args},
        scaling_config=ray.train.ScalingConfig(num_workers=WORLD, use_gpu=False),
        run_config=ray.train.RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"),
    )
    trainer.fit()
    with open(answer) as file:
        return float(file.read())


def checked(run) -> None:
    value = run(all_reduce_once)
    assert value == sum(range(1, WORLD + 1)), value


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def failure_latency(call) -> tuple[float, str]:
    """Seconds from the rank's raise to the caller's exception, and the exception's type."""
    try:
        call()
    except Exception as error:
        caught = time.time()
        text = " ".join(str(e) for e in _chain(error))
        raised = float(re.search(r"raised at (\d+\.\d+)", text).group(1))
        return caught - raised, type(error).__name__
    raise RuntimeError("the failing call returned")


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


# ---------------------------------------------------------------- the report


def whole_call_and_failure(runs: dict, calls: int, warm_up: bool) -> list[str]:
    """Prints both tables; returns their goals' lines."""
    times = {}
    for name, run in runs.items():
        if warm_up:
            run(all_reduce_once)
        times[name] = [timed(functools.partial(checked, run)) for _ in range(calls)]
    failures = {name: failure_latency(functools.partial(run, raise_on_one_rank)) for name, run in runs.items()}
    whole = {name: statistics.median(seconds) for name, seconds in times.items()}
    call_ratio = whole["fanrun"] / whole["TorchTrainer"]
    print(f"Whole call: import torch, init_process_group, all_reduce, return (median s of {calls}"
          f"{', after a warm-up' if warm_up else ''})")
    for name, seconds in times.items():
        print(f"  {name:<13} {whole[name]:7.3f}   (min {min(seconds):.3f}, max {max(seconds):.3f})")
    print(f"  fanrun/TorchTrainer {call_ratio:.2f}x\n")
    print(f"Failure latency: rank {FAILING_RANK} (node 1) raises -> the caller's exception (s)")
    for name, (seconds, kind) in failures.items():
        print(f"  {name:<13} {seconds:7.3f}   ({kind})")
    print()
    fanrun_failure = failures["fanrun"][0]
    return [
        f"  whole call at most {CALL_GOAL}x TorchTrainer.fit: {call_ratio:.2f}x {'met' if call_ratio <= CALL_GOAL else 'MISSED'}",
        f"  failure latency at most {FAILURE_GOAL_S:g} s: {fanrun_failure:.3f} s "
        f"{'met' if fanrun_failure <= FAILURE_GOAL_S else 'MISSED'}",
    ]


# ---------------------------------------------------------------- the cluster's processes


def cluster_processes() -> dict[int, tuple[int, str]]:
    """Every live descendant of this process (the cluster's daemons and their workers), by pid,
    with its start time (so that a reused pid is never taken for it) and its command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, parents = {}, [os.getpid()]
    while parents:
        for pid in children.get(parents.pop(), []):
            started = process_start(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as file:
                    command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
            except OSError:
                continue
            if started is not None:
                found[pid] = (started, command)
                parents.append(pid)
    return found


def process_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def end_what_shutdown_left(processes: dict[int, tuple[int, str]]) -> None:
    """Waits up to SHUTDOWN_GRACE_S for the cluster's processes to end, then kills and names each
    one left: Ray Train's controller actor has outlived its cluster's shutdown by more than a
    minute on a loaded 2-core machine, and a benchmark stops all it started."""
    handles = {}
    for pid, (started, command) in processes.items():
        try:
            handle = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        if process_start(pid) == started:
            handles[handle] = (pid, command)
        else:
            os.close(handle)  # the pid was reused
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    waiting = set(handles)
    while waiting and (remaining := deadline - time.monotonic()) > 0:
        ended, _, _ = select.select(list(waiting), [], [], remaining)
        waiting.difference_update(ended)
    if waiting:
        print(f"ray.py: {len(waiting)} of the cluster's processes were still running {SHUTDOWN_GRACE_S:.0f} s "
              f"after its shutdown; they are killed now:", file=sys.stderr)
        for handle in waiting:
            print(f"  {handles[handle][0]}: {handles[handle][1]}", file=sys.stderr)
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        select.select(list(waiting), [], [], SHUTDOWN_GRACE_S)
    for handle in handles:
        os.close(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5, help="timed whole calls of each, after one warm-up")
    parser.add_argument("--steps", type=int, default=300, help="training steps timed in the throughput run")
    parser.add_argument("--rounds", type=int, default=None, help="alternating throughput rounds (default: --calls)")
    parser.add_argument("--throughput-only", action="store_true", help="skip the whole-call and failure parts")
    parser.add_argument("--smoke", action="store_true", help="one call of each, no warm-up, a few steps: proves it runs")
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.steps = 1, 20

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    from ray.cluster_utils import Cluster

    import fanrun

    logging.getLogger("ray").setLevel(logging.ERROR)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": RANKS_PER_NODE, "include_dashboard": False})
    storage = tempfile.mkdtemp(prefix="fanrun-ray-bench-")
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=RANKS_PER_NODE)
        cluster.wait_for_nodes()
        fanrun.ray_init(address=cluster.address, log_to_driver=False)
        print(f"Ray {__import__('ray').__version__}, {NODES} nodes x {RANKS_PER_NODE} CPU ranks (gloo), "
              f"{os.cpu_count()} cores\n", flush=True)

        runs = {"fanrun": fanrun_call,
                "TorchTrainer": lambda work, *a: ray_train_call(work, *a, storage=storage)}
        goals = []
        if not args.throughput_only:
            goals += whole_call_and_failure(runs, args.calls, warm_up=not args.smoke)
        # In alternating rounds, so that a slow spell of the machine falls on both.
        rounds = {name: [] for name in runs}
        for _ in range(max(1, args.rounds or args.calls)):
            for name, run in runs.items():
                rounds[name].append(run(train_steps, args.steps))
        step_s = {name: statistics.median(seconds) for name, seconds in rounds.items()}
        throughput_ratio = step_s["TorchTrainer"] / step_s["fanrun"]
        print(f"Training throughput: DDP steps in the ranks, {args.steps} steps (median ms per step of "
              f"{len(rounds['fanrun'])} alternating rounds)")
        for name, seconds in step_s.items():
            print(f"  {name:<13} {seconds * 1000:7.2f}   ({', '.join(f'{s * 1000:.2f}' for s in rounds[name])})")
        print(f"  fanrun/TorchTrainer {throughput_ratio:.3f}x (steps per second)\n")
        print("Goals:")
        for line in goals:
            print(line)
        # The goal is parity; outside it, the rounds above show whether it is the machine's noise.
        verdict = ("met" if abs(throughput_ratio - 1) <= THROUGHPUT_TOLERANCE
                   else "not within (fanrun faster)" if throughput_ratio > 1 else "MISSED (fanrun slower)")
        print(f"  throughput 1.00 +/- {THROUGHPUT_TOLERANCE}: {throughput_ratio:.3f} {verdict}")
    finally:
        fanrun.ray_shutdown()
        processes = cluster_processes()
        cluster.shutdown()
        end_what_shutdown_left(processes)


if __name__ == "__main__":
    main()
