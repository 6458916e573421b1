"""Benchmark: what the GPU health gate costs a call. The cheap gate (NVML's answers for every GPU
of the call, judged) is timed on its own, as the call path runs it once the GPUs' locks are held:
the first gate of a process (which opens NVML) apart, then the median of --calls more. --deep
times the deep check (a short fanrun call of bf16 matrix products, a copy and an all-reduce on
every GPU) with `fanrun doctor --deep`'s path, and prints each GPU's figures against its model's.
    python benchmarks/health.py              # every GPU of this machine, real NVML
    python benchmarks/health.py --deep       # and the deep check
    python benchmarks/health.py --smoke      # no GPU needed: 2 recorded H200s (cpp/src/accelerators/recorded_nvml.c)
Goals, on a H200 node: the cheap gate at most 50 ms per call, the deep check at most 15 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHEAP_GOAL_MS = 50.0
DEEP_GOAL_S = 15.0
SEAM = Path(__file__).resolve().parents[1] / "cpp" / "src" / "accelerators" / "recorded_nvml.c"


def record_a_healthy_node(directory: Path, gpus: int) -> None:
    """Points this process's NVML at the stand-in, answering for `gpus` healthy H200s."""
    library, answers = directory / "librecorded_nvml.so", directory / "answers.txt"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(SEAM)], check=True)
    answers.write_text("driver recorded\n" + "".join(
        f"gpu {i}\nname NVIDIA H200\nuuid GPU-{i:08d}-0000-0000-0000-000000000000\nmemory {141 << 30} {1 << 29}\n"
        f"ecc_uncorrected 0\nremapped_rows 0 0 0 0\nthrottle_reasons 0x1\npcie 1 5 16 16\nutilization 0\n"
        for i in range(gpus)))
    os.environ["FANRUN_NVML_LIBRARY"], os.environ["FANRUN_RECORDED_NVML"] = str(library), str(answers)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)


def spec_of_every_gpu(level: str):
    from fanrun._launch import call
    from fanrun._spec.program import RankProgram
    from fanrun._spec.spec import Options

    asked = Options(num_accelerators=None, accelerator=None, timeout=None, tracking=False, display="quiet", health=level)
    return call.plan("health-benchmark", asked, RankProgram.function())


def time_cheap(calls: int) -> tuple[float, float, int]:
    """(first gate ms, median ms of the next `calls`, GPUs)."""
    from fanrun._health.check import Gate

    spec = spec_of_every_gpu("cheap")
    gpus = len(spec.gpus())
    if not gpus:
        raise SystemExit("no GPU here: run with --smoke to time the gate against recorded NVML answers")
    times = []
    for _ in range(calls + 1):
        started = time.perf_counter()
        Gate(spec).checked_spec()
        times.append((time.perf_counter() - started) * 1000)
    return times[0], statistics.median(times[1:]), gpus


def time_deep():
    """(seconds, the gate) of the deep check on every GPU, or (seconds, the reason it could not run)."""
    from fanrun._errors import GpuHealthError
    from fanrun._launch import call

    spec = spec_of_every_gpu("deep")
    started = time.perf_counter()
    try:
        gate = call.check_health(spec)
    except GpuHealthError as error:
        return time.perf_counter() - started, str(error).splitlines()[0]
    return time.perf_counter() - started, gate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50, help="cheap gates timed after the first (default 50)")
    parser.add_argument("--deep", action="store_true", help="also time the deep check")
    parser.add_argument("--smoke", action="store_true", help="2 recorded H200s instead of this machine's GPUs")
    options = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="fanrun-health-bench-")
    if options.smoke:
        record_a_healthy_node(Path(scratch.name), 2)
        options.calls, options.deep = min(options.calls, 20), True  # the deep check says why it cannot run
    first_ms, median_ms, gpus = time_cheap(options.calls)
    where = "recorded NVML answers (--smoke)" if options.smoke else "this machine's NVML"
    print(f"GPU health gate, {gpus} GPUs, {where}\n")
    print("| check | first call | per call (median) | goal | met |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| cheap | {first_ms:.2f} ms | {median_ms:.2f} ms ({options.calls} calls) | <= {CHEAP_GOAL_MS:g} ms | "
          f"{'yes' if median_ms <= CHEAP_GOAL_MS else 'NO'} |")
    deep_figures = None
    if options.deep:
        seconds, outcome = time_deep()
        if isinstance(outcome, str):
            print(f"| deep | could not run: {outcome} | - | <= {DEEP_GOAL_S:g} s | - |")
        else:
            print(f"| deep | {seconds:.1f} s | - | <= {DEEP_GOAL_S:g} s | {'yes' if seconds <= DEEP_GOAL_S else 'NO'} |")
            deep_figures = outcome
    if deep_figures is not None:
        print_figures(deep_figures)
    print(f"\nGoal: cheap gate at most {CHEAP_GOAL_MS:g} ms per call, deep check at most {DEEP_GOAL_S:g} s, on a H200 node.")
    scratch.cleanup()
    return 0


def print_figures(gate) -> None:
    from fanrun._health import figures

    print("\n| GPU | name | bf16 TFLOP/s (expected) | copy TB/s (expected) | all-reduce bus GB/s | verdict |")
    print("| --- | --- | --- | --- | --- | --- |")
    for gpu in gate.gpus:
        measured = gate.figures.get(gpu.nvml_index, {})
        model = figures.expected(gpu.name)
        tflops = f"{measured.get('bf16_tflops', 0):.0f} ({model.bf16_tflops:g})" if model else f"{measured.get('bf16_tflops', 0):.0f}"
        copy = f"{measured.get('copy_tbps', 0):.2f} ({model.memory_tbps:g})" if model else f"{measured.get('copy_tbps', 0):.2f}"
        bus = measured.get("all_reduce_bus_gbps")
        verdict = "; ".join(gate.problems[gpu.nvml_index]) or "healthy"
        print(f"| {gpu.nvml_index} | {gpu.name} | {tflops} | {copy} | {'-' if bus is None else f'{bus:.0f}'} | {verdict} |")
    for note in gate.notes:
        print(f"note: {note}")


if __name__ == "__main__":
    sys.exit(main())
