"""Benchmark: what MLflow tracking, fanrun's default, adds to a whole .distributed() call made from a
script: the first call of a process and the later ones, for ranks that return at once and ranks
that sleep, tracking on and off alternating, each script a new process. Two functions: one that
never imports mlflow (goal: on within 5 % or 0.2 s of off), and the seed notebook's pattern, one
that imports mlflow and logs a metric (goal: on at most 1.2x off), both whether or not the call
is tracked."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from launch import package_version  # benchmarks/launch.py, beside this file

# What tracking may add to a call of a function that never imports mlflow: 5 % or this much,
# whichever is larger.
GOAL_S = 0.2
GOAL_SHARE = 0.05
# What a call of a function that imports mlflow may cost tracked, against untracked.
GOAL_RATIO_MLFLOW = 1.2
SCRIPT_TIMEOUT_S = 600.0

# A user's script: `calls` calls in a row, each timed alone; what it prints is the report's input.
CALLER = textwrap.dedent(
    """
    import json, sys, time
    from fanrun import distributed

    tracking, seconds, calls, ranks = sys.argv[1] == "on", float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    uses_mlflow = sys.argv[5] == "mlflow"

    @distributed(num_accelerators=ranks, tracking=tracking)
    def work(seconds):
        import time
        if uses_mlflow:
            import mlflow
            mlflow.log_metric("loss", 1.0)
        time.sleep(seconds)  # what a GPU rank mostly does: wait on its device, not on the CPU
        return 1

    times, agent_cpu_s = [], None
    for call in range(calls):
        started = time.perf_counter()
        assert work.distributed(seconds) == [1] * ranks
        times.append(time.perf_counter() - started)
        if call == 0 and tracking:  # the CPU time of the process that tracks the calls, for the first one
            import os
            from fanrun._tracking import agent_connection
            with open(f"/proc/{agent_connection.current().process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            agent_cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    print("times", json.dumps(times), flush=True)
    print("agent_cpu_s", json.dumps(agent_cpu_s), flush=True)
    """
)


def run_script(mode: str, seconds: float, calls: int, ranks: int, function: str, env: dict,
               workdir: Path) -> tuple[list[float], float, float | None]:
    """Each call's seconds, the whole script's (interpreter start to exit), and the CPU seconds the
    tracking agent had used by the first call's end (None untracked)."""
    printed: dict = {}
    times, whole = script_times(CALLER, [mode, str(seconds), str(calls), str(ranks), function], env, workdir,
                                SCRIPT_TIMEOUT_S, printed)
    return times, whole, printed.get("agent_cpu_s")


def script_times(code: str, args: list[str], env: dict | None, workdir: Path, timeout_s: float,
                 printed: dict | None = None) -> tuple[list[float], float]:
    """Runs `python -c code args...`, which prints "times <JSON list>": that list, and the whole
    script's seconds (interpreter start to exit). Any other "name <JSON>" line goes into `printed`."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=workdir,
                          timeout=timeout_s)
    whole = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the {args[0]} script failed with {done.returncode}:\n{done.stderr[-3000:]}")
    values = {}
    for line in done.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name.isidentifier() and value:
            try:
                values[name] = json.loads(value)
            except ValueError:
                continue
    if printed is not None:
        printed.update(values)
    return values["times"], whole


def measure(seconds: float, calls: int, ranks: int, repeat: int, function: str, env: dict,
            workdir: Path) -> dict[str, dict[str, list[float]]]:
    """mode -> {"first": [...], "later": [...], "script": [...]}: on and off take turns, so that
    drift in the machine's load lands on both."""
    samples = {mode: {"first": [], "later": [], "script": [], "agent_cpu": []} for mode in ("on", "off")}
    for index in range(repeat):
        for mode in samples:
            times, whole, agent_cpu_s = run_script(mode, seconds, calls, ranks, function, env, workdir)
            samples[mode]["first"].append(times[0])
            samples[mode]["later"] += times[1:]
            samples[mode]["script"].append(whole)
            if agent_cpu_s is not None:
                samples[mode]["agent_cpu"].append(agent_cpu_s)
            later = f", later {statistics.median(times[1:]):.3f} s" if times[1:] else ""
            print(f"  {function}, sleep {seconds:g} s, {mode} #{index + 1}: first {times[0]:.3f} s{later}, script {whole:.3f} s",
                  file=sys.stderr, flush=True)
    return samples


def rows(function: str, seconds: float, calls: int, samples: dict) -> list[str]:
    lines = []
    for what, label in (("first", "first call"), ("later", f"calls 2-{calls}"), ("script", "whole script")):
        on, off = samples["on"][what], samples["off"][what]
        if not on or not off:
            continue
        median_on, median_off = statistics.median(on), statistics.median(off)
        added = median_on - median_off
        if function == "mlflow":
            within = median_on <= GOAL_RATIO_MLFLOW * median_off
        else:
            within = added <= max(GOAL_SHARE * median_off, GOAL_S)
        verdict = "within" if within else "OVER"
        goal = verdict if what != "script" else f"({verdict})"
        lines.append(f"| {function} | {seconds:g} | {label} | {median_on:.3f} | {median_off:.3f} | {added:+.3f} | "
                     f"{median_on / median_off:.2f}x | {goal} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sleeps", type=float, nargs="+", default=[0.0, 5.0], help="seconds each rank sleeps")
    parser.add_argument("--calls", type=int, default=5, help="calls per script")
    parser.add_argument("--repeat", type=int, default=5, help="scripts per mode and sleep")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per call: GPUs where there are as many, else CPU processes")
    parser.add_argument("--functions", nargs="+", choices=["sleep", "mlflow"], default=["sleep", "mlflow"],
                        help="sleep: the ranks only sleep; mlflow: they import mlflow and log a metric first")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.sleeps, args.calls, args.repeat = [0.0], 2, 1
    load = os.getloadavg()
    print(f"Machine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}, "
          f"fanrun {package_version('fanrun')}, mlflow {package_version('mlflow')}; load average before: {load[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="fanrun-tracking-cost-") as scratch:
        # fanrun's default store, in the scratch directory: what a user gets with MLflow unconfigured.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "FANRUN_TRACKING"}
        env["XDG_DATA_HOME"] = str(Path(scratch) / "data")
        workdir = Path(scratch) / "work"
        workdir.mkdir()
        run_script("on", 0.0, 1, args.ranks, "sleep", env, workdir)  # the store's creation, once: not what each call costs
        results = {(function, seconds): measure(seconds, args.calls, args.ranks, args.repeat, function, env, workdir)
                   for function in args.functions for seconds in args.sleeps}
    later = f" (calls 2-{args.calls}: median of every such call)" if args.calls > 1 else ""
    print(f"\n{args.ranks} ranks a call. Seconds, median of {args.repeat} scripts per mode{later}, tracking on and off alternating; "
          f"goal: on within {GOAL_SHARE:.0%} or {GOAL_S} s of off (sleep), on at most {GOAL_RATIO_MLFLOW}x off (mlflow)")
    print("| function | ranks sleep s | call | on | off | on - off | on/off | goal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (function, seconds), samples in results.items():
        print("\n".join(rows(function, seconds, args.calls, samples)))
    # On a machine of few cores, a first call is bound by what every process of it does on the CPU:
    # the tracking agent's share of that work is what tracking adds there.
    for (function, seconds), samples in results.items():
        if samples["on"]["agent_cpu"]:
            print(f"Tracking agent's CPU time by the first call's end ({function}, sleep {seconds:g} s): "
                  f"{statistics.median(samples['on']['agent_cpu']):.2f} s, on {os.cpu_count()} cores")
    print(f"Load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
