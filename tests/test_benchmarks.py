"""Every script in benchmarks/ runs to the end in its smoke mode (tiny sizes, CPU), so that none
can rot unnoticed, and leaves no process behind; for the GPU paths, everything but the GPU: the
steps of the GPU session name files, tests and arguments that exist, and the decorator arguments
built for GPUs are valid."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processes import processes_with_environment, wait_gone

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

# Each script, the arguments of its smoke run, and lines its report must hold: its table's
# header and the ratios against its peers.
SMOKE_RUNS = {
    "checkpoint.py": ([], ["Save (durable except torch.save)", "fanrun/dcp-8", "Load, cold cache", "dcp.async_save", "Goals:"]),
    # make test-python installs nginx, so the HTTP rows run too.
    "data.py": ([], ["method ", "volume, cold disk", "webdataset", "streaming", "volume (http, cold)",
                     "webdataset (http, cold)", "Goals"]),
    "gpu_checks.py": ([], ["== DDP demo", "== warm calls: cold call", "== kept calls: first call", "== rank 1 raises mid-training: RuntimeError",
                           "is SIGKILLed mid-training: RankFailedError", "hangs, rank 0 waits in gloo (timeout=10 s): TimeoutError"]),
    "health.py": ([], ["| check | first call | per call (median) | goal | met |", "| cheap |", "ms (20 calls)",
                       "| deep | could not run:", "sees no CUDA GPU", "Goal: cheap gate at most 50 ms per call"]),
    "launch.py": ([], ["Launch wall time", "tracked/fanrun", "fanrun/mp.spawn", "fanrun/torchrun", "fanrun/notebook_launcher",
                       "warm/notebook_launcher", "warm launch wall time at most 2x notebook_launcher's on CPUs",
                       "Failure latency", "Goals", "launch wall time with tracking (the default) within 5% or 0.2 s of without",
                       "failure latency with tracking (the default) within 0.05 s of without", "Leftover processes:\n  none"]),
    "loader_transfer.py": ([], ["bytes/batch", "CPU ratio", "1048576"]),
    "ray.py": ([], ["Whole call", "fanrun/TorchTrainer", "Failure latency", "Training throughput", "Goals:"]),
    "ray_gpu.py": ([], ["DDP example, 3 epochs, 2 ranks, gloo on CPUs", "rank 1 on cpu", "losses equal"]),
    "output.py": ([], ["| display | lines/s | caller CPU us/line |", "| logs |", "| quiet |"]),
    "panel.py": ([], ["| display | caller CPU share of one core |", "| panel |", "| quiet |", "Goals:",
                      "the panel's own CPU (panel - quiet)"]),
    "read_through.py": (["--dir", "{tmp}"], ["cat x2:", "whole x2:", "read_through x2:"]),
    "restart.py": ([], ["seconds from the death of rank 1 to the next attempt's first step", "  fanrun keep ",
                        "  fanrun fresh ", "Goal: a kept restart within 2 s: "]),
    "results.py": ([], ["cost of returning s", "torch.save+load s", "Goal: returning costs at most 1.5x"]),
    "slurm.py": ([], ["Whole call over 2 Slurm nodes x 2 gloo ranks", "  fanrun ", "  srun torchrun ", "Goals:",
                      "fanrun/srun torchrun <= 0.8"]),
    "stall.py": ([], ["(a) Detection latency", "| rank 1 sleeps in its Dataset |", "| rank 1 skips a collective |",
                      "(b) Observation cost", "watched/not watched:", "(d) What watching adds", "us a step; one ask",
                      "(c) torch alone", "default_pg_timeout", "flight recorder's dump", "Goals:"]),
    "table.py": ([], ["rows/s", "fanrun, cold", "ready-batches", "pyarrow", "hf-datasets", "streaming", "ray-data", "Goals:",
                      "warm: TableDataset >= 1.5x the best peer", "of batches it never reads"]),
    "throughput.py": ([], ["fanrun/torchrun", "ddp ", "fsdp "]),
    "tracking.py": ([], ["| mode |", "log_metric every step (fanrun's default)", "vs off"]),
    "tracking_cost.py": ([], ["| function | ranks sleep s | call | on | off | on - off | on/off | goal |", "| sleep | 0 | first call |",
                              "| mlflow | 0 | first call |", "| calls 2-2 |", "| whole script |"]),
    "warm_loop.py": ([], ["| ranks sleep s | calls | first | median | slowest | median/first | goal |", "| 0 | warm |",
                          "| 0 | kept |", "Goal: warm calls' median at most 1.2x the first warm call: "]),
}
# A Ray cluster binds to the machine's address, unless it runs where loopback alone is up; the
# Slurm cluster's daemons listen on loopback there too.
IN_A_NETWORK_NAMESPACE = {"ray.py", "ray_gpu.py", "table.py", "slurm.py"}
# gpu_session.sh drives the GPU machine itself; test_gpu_session_steps_exist checks it.
NOT_PYTHON = {"gpu_session.sh"}


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == set(SMOKE_RUNS) | NOT_PYTHON


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_benchmark_smoke_run_prints_its_report(script, tmp_path):
    args, expected = SMOKE_RUNS[script]
    args = [a.format(tmp=tmp_path) for a in args]
    # The scripts run from a scratch directory, as they would from anywhere: nothing they
    # write (MLflow stores, corpora) lands in the checkout.
    command = [sys.executable, str(BENCHMARKS / script), "--smoke", *args]
    if script in IN_A_NETWORK_NAMESPACE:
        command = [sys.executable, str(ROOT / "tests" / "ray" / "netns.py"), *command]
    done = run_leaving_nothing(command, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in expected:
        assert text in done.stdout, f"{script} --smoke did not print {text!r}:\n{done.stdout[-3000:]}"


def run_leaving_nothing(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Runs a benchmark, then checks that nothing it started (its peers' launchers and ranks
    included, which inherit the marked environment) outlives it by more than a few seconds."""
    marker = f"FANRUN_BENCHMARK_SMOKE={cwd}\0"
    # Files, not pipes: a pipe would keep the run waiting for whatever still holds its end.
    with open(cwd / "smoke.out", "w+") as out, open(cwd / "smoke.err", "w+") as err:
        done = subprocess.run(command, stdout=out, stderr=err, cwd=cwd, timeout=600,
                              env={**os.environ, "FANRUN_BENCHMARK_SMOKE": str(cwd)})
        left = processes_with_environment(marker.encode())
        still = wait_gone([pid for pid, _ in left], timeout=15)
        for pid in still:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the test fails, and leaves nothing either
        assert still == [], f"left running: {[command for pid, command in left if pid in still]}"
        out.seek(0), err.seek(0)
        done.stdout, done.stderr = out.read(), err.read()
    return done


@pytest.mark.slow
def test_panel_benchmark_smoke_run_with_its_caller_in_a_notebook(tmp_path):
    done = run_leaving_nothing([sys.executable, str(BENCHMARKS / "panel.py"), "--smoke", "--where", "notebook"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "caller in a notebook" in done.stdout and "| panel |" in done.stdout, done.stdout[-3000:]


def gpu_session_steps() -> list[tuple[str, list[str]]]:
    """Every step of every part the GPU session's `case` names."""
    parts = re.findall(r"^    ([a-z-]+)\)", (BENCHMARKS / "gpu_session.sh").read_text(), re.MULTILINE)
    assert "restart-tests" in parts and "checks" in parts, parts
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_session.sh"), *parts], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "DRY_RUN": "1"}, timeout=60)
    assert done.returncode == 0, done.stderr
    steps = []
    for line in done.stdout.splitlines():
        if line.startswith("step "):
            _, name, _limit, *command = shlex.split(line)
            steps.append((name, command))
    return steps


def test_gpu_session_steps_exist():
    """Each step of the GPU session runs a script that exists, and each of its pytest steps
    selects at least one test: a renamed test or file would otherwise be found on the GPU."""
    steps = gpu_session_steps()
    assert len(steps) >= 10
    for name, command in steps:
        assert command[0] == "python3", (name, command)
        if command[1:3] == ["-m", "pytest"]:
            collected = subprocess.run([sys.executable, *command[1:], "--collect-only", "-q"],
                                       capture_output=True, text=True, cwd=ROOT, timeout=300)
            # pytest exits with 5 when the selection is empty.
            assert collected.returncode == 0, f"step {name} selects no test: {collected.stdout[-2000:]}"
        else:
            assert (ROOT / command[1]).is_file(), f"step {name} runs {command[1]}, which does not exist"


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("benchmark", ["checkpoint", "results", "stall"])
def test_gpu_step_arguments_are_valid(benchmark):
    """The GPU session's step of the benchmark parses, and the decorator it builds for --device
    cuda is accepted and plans one rank per GPU on a machine with two."""
    from fanrun import distributed
    from fanrun._accelerators import Gpu, Inventory, parse_accelerator_type, plan_run

    module = load_benchmark(benchmark)
    (command,) = [c for name, c in gpu_session_steps() if name == benchmark]
    args = module.parse_args(command[2:])
    assert args.device == "cuda"
    for ranks in args.ranks if isinstance(args.ranks, list) else [args.ranks]:
        arguments = module.decorator_arguments(ranks, args.device)
        distributed(**arguments)(lambda: None)  # raises for an argument @distributed rejects
        gpus = tuple(Gpu(i, "NVIDIA H200", f"GPU-{i}", 141 << 30) for i in range(2))
        plan = plan_run(arguments["num_accelerators"], parse_accelerator_type(arguments["accelerator_type"]),
                        Inventory(gpus, gpus, ""))
        assert plan.use_gpus and plan.world_size == ranks
