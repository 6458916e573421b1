"""Calls in a loop: a script makes back-to-back calls of one function, as a notebook cell with
a loop does, four ways:
- cold: warm=False, every call starts its ranks' interpreters;
- warm, no warmup: warm=True alone, so the first call is cold and starts the spares of the next;
- warm: fanrun.warmup(wait=True) first, then each call runs in fresh processes (spares whose
  imports are done), and its replacements start importing as the call starts;
- kept: keep_alive=True after the warmup, every call in the same processes.

The figure is each call's wall time; the goal is the median of the warm calls at most GOAL x
the first warm call, whatever the ranks do. Ranks that return at once are the worst case: the
next call comes before its spares' imports are done. The first calls of "cold" and "warm, no
warmup" tell what starting spares during a script's first call costs it.

    python benchmarks/warm_loop.py [--calls 10] [--sleeps 0 3] [--ranks 2] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

from launch import package_version  # benchmarks/launch.py, beside this file
from tracking_cost import script_times

GOAL = 1.2
SCRIPT_TIMEOUT_S = 900.0

# A user's script: warmed up, then `calls` calls in a row, each timed alone.
CALLER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import fanrun
    from fanrun import distributed

    mode, seconds, calls, ranks = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    @distributed(num_accelerators=ranks, warm=mode != "cold", keep_alive=mode == "kept", tracking=False)
    def step(seconds):
        import os, time
        import torch
        time.sleep(seconds)  # what a GPU rank mostly does: wait on its device, not on the CPU
        return int(os.environ["RANK"])

    if mode in ("warm", "kept"):
        fanrun.warmup(ranks, wait=True)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        assert step.distributed(seconds) == list(range(ranks))
        times.append(time.perf_counter() - started)
    fanrun.cooldown()
    print("times", json.dumps(times), flush=True)
    """
)


def run_script(mode: str, seconds: float, calls: int, ranks: int, workdir: Path) -> list[float]:
    return script_times(CALLER, [mode, str(seconds), str(calls), str(ranks)], None, workdir, SCRIPT_TIMEOUT_S)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per script")
    parser.add_argument("--sleeps", type=float, nargs="+", default=[0.0, 3.0], help="seconds each rank sleeps")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per call: GPUs where there are as many, else CPU processes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.sleeps = 3, [0.0]
    print(f"Machine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}, "
          f"torch {package_version('torch')}, fanrun {package_version('fanrun')}; load average before: {os.getloadavg()[0]:.2f}")
    print(f"\n{args.calls} back-to-back calls, {args.ranks} ranks each; seconds")
    print("| ranks sleep s | calls | first | median | slowest | median/first | goal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="fanrun-warm-loop-") as scratch:
        for seconds in args.sleeps:
            for mode in ("cold", "warm, no warmup", "warm", "kept"):
                times = run_script(mode, seconds, args.calls, args.ranks, Path(scratch))
                ratio = statistics.median(times) / times[0]
                goal = ("met" if ratio <= GOAL else "NOT met") if mode == "warm" else "-"
                if mode == "warm":
                    verdicts.append(ratio <= GOAL)
                print(f"| {seconds:g} | {mode} | {times[0]:.3f} | {statistics.median(times):.3f} | {max(times):.3f} | "
                      f"{ratio:.2f}x | {goal} |", flush=True)
                print(f"  {mode}, sleep {seconds:g} s: " + " ".join(f"{t:.3f}" for t in times), file=sys.stderr, flush=True)
    print(f"\nGoal: warm calls' median at most {GOAL}x the first warm call: "
          f"{'met' if all(verdicts) else 'NOT met'} ({sum(verdicts)} of {len(verdicts)} sleeps)")
    print(f"Load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
