"""Restart latency: from a rank's death to the next attempt's first training step, with fanrun's
max_restarts (restart="keep": the other ranks called again in their processes; restart="fresh":
every rank in a new process) against torchrun's --max-restarts, on the same machine in one run.

Each rank joins the process group, takes a first step (an all-reduce) and notes its time, then
keeps stepping. In the first attempt, the last rank notes the time and SIGKILLs itself after its
first step. The figure is the latest first step of the second attempt's ranks minus that death.
Goals: fanrun's kept restart at most GOAL_S seconds, and each of fanrun's at most 0.5x torchrun's.

    python benchmarks/restart.py [--ranks 2] [--repeat 3] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL = 0.5
GOAL_S = 2.0
# How long the surviving ranks keep stepping before they give up on their own (they are stopped
# long before: a launcher that did not notice the death would show as a hang).
STEP_FOR_S = 60.0


def train(directory: str) -> None:
    """One rank of one attempt."""
    import torch
    import torch.distributed as dist

    attempt = int(os.environ.get("FANRUN_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    value = torch.ones(1, device="cuda" if on_gpu else "cpu")
    dist.all_reduce(value)
    if on_gpu:
        torch.cuda.synchronize()
    Path(directory, f"step-{attempt}-{rank}").write_text(repr(time.time()))
    if attempt == 0 and rank == world_size - 1:
        Path(directory, "died").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt > 0:
        dist.destroy_process_group()
        return
    deadline = time.monotonic() + STEP_FOR_S
    while time.monotonic() < deadline:
        dist.all_reduce(value)  # fails once the killed rank's connections are gone
        time.sleep(0.01)


def latency(directory: str, ranks: int) -> float:
    died = float(Path(directory, "died").read_text())
    return max(float(Path(directory, f"step-1-{rank}").read_text()) for rank in range(ranks)) - died


def under_fanrun(ranks: int, directory: str, restart: str) -> float:
    from fanrun import distributed

    distributed(num_accelerators=ranks, tracking=False, max_restarts=1, restart=restart)(train).distributed(directory)
    return latency(directory, ranks)


# A restart that has not reached its first step after this long has failed (a smoke run's
# launchers take a few seconds; it only shows that the script runs).
CALL_TIMEOUT_S = 120.0
SMOKE_CALL_TIMEOUT_S = 40.0


class RestartFailed(Exception):
    """The launcher did not bring the second attempt to its first step."""


def under_torchrun(ranks: int, directory: str, timeout: float) -> float:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "--max-restarts=1", __file__, "--worker", directory]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _, stderr = stop_torchrun(launcher, directory)
        raise RestartFailed(f"no end after {timeout:g} s; {_last_error(stderr, 'no error printed')}") from None
    if not all(Path(directory, f"step-1-{rank}").exists() for rank in range(ranks)):
        raise RestartFailed(f"the second attempt never stepped: {_last_error(stderr, f'exit {launcher.returncode}')}")
    return latency(directory, ranks)


def stop_torchrun(launcher: subprocess.Popen, directory: str) -> tuple[bytes, bytes]:
    """SIGTERM, on which torchrun stops its workers; then SIGKILL for any of them left, found by
    their command line: torchrun starts each in a session of its own, out of reach of its group."""
    launcher.terminate()
    try:
        out = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        launcher.kill()
        out = launcher.communicate()
    marker = f"--worker\0{directory}\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if marker in file.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue  # gone meanwhile
    return out


def _last_error(stderr: bytes | None, otherwise: str) -> str:
    lines = [line.strip() for line in (stderr or b"").decode(errors="replace").splitlines() if "Error" in line]
    return lines[-1][:300] if lines else otherwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.worker:  # a torchrun rank
        train(args.worker)
        return
    if args.smoke:
        args.repeat = 1
    os.environ.pop("FANRUN_RESTART_COUNT", None)
    print(f"{args.ranks} ranks; {args.repeat} rounds, alternating; seconds from the death of rank {args.ranks - 1} "
          f"to the next attempt's first step", flush=True)
    timeout = SMOKE_CALL_TIMEOUT_S if args.smoke else CALL_TIMEOUT_S
    contestants = {"fanrun keep": functools.partial(under_fanrun, restart="keep"),
                   "fanrun fresh": functools.partial(under_fanrun, restart="fresh"),
                   "torchrun": functools.partial(under_torchrun, timeout=timeout)}
    times: dict[str, list[float]] = {name: [] for name in contestants}
    failures: dict[str, str] = {}
    for _ in range(args.repeat):
        for name, run in contestants.items():
            if name in failures:
                continue  # a launcher that could not restart once is not retried
            with tempfile.TemporaryDirectory(prefix="fanrun-restart-bench-") as directory:
                try:
                    times[name].append(run(args.ranks, directory))
                except RestartFailed as error:
                    failures[name] = str(error)
    medians = {name: statistics.median(values) for name, values in times.items() if values}
    for name, values in times.items():
        shown = f"{medians[name]:7.3f} s   ({', '.join(f'{v:.3f}' for v in values)})" if values else "  -"
        print(f"  {name:<13} {shown}{f'   FAILED: {failures[name]}' if name in failures else ''}")
    if "fanrun keep" in medians:
        verdict = "met" if medians["fanrun keep"] <= GOAL_S else "NOT MET"
        print(f"Goal: a kept restart within {GOAL_S:g} s: {verdict}")
    for name in ("fanrun keep", "fanrun fresh"):
        if name in medians and "torchrun" in medians:
            ratio = medians[name] / medians["torchrun"]
            print(f"{name}/torchrun {ratio:.2f}x; goal at most {GOAL}x: {'met' if ratio <= GOAL else 'NOT MET'}")
        else:
            print(f"{name}/torchrun: goal at most {GOAL}x: UNKNOWN (a launcher did not restart)")


if __name__ == "__main__":
    main()
