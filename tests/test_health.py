"""The GPU health gate (src/fanrun/_health/) on its real path, on a machine without a GPU: the
engine's NVML reader loads recorded_nvml.c, a stand-in libnvidia-ml.so that answers from recorded
answers, and the call path meets an ECC error, a throttled clock, a narrow PCIe link, another
process's memory or a missing GPU as it would on a node. The ranks never touch CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fanrun
from fanrun import _accelerators
from gpus import needs_gpus
from recorded_nvml import GIB, build, gpu_answers, node_answers, uuid
from fanrun._health import reader

@pytest.fixture(scope="session")
def recorded_nvml(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("nvml"))


@pytest.fixture
def node(recorded_nvml, tmp_path, monkeypatch):
    """Records a node's answers (one text per GPU) for this process and the processes it starts."""
    def record(*gpus: str) -> Path:
        answers = tmp_path / "answers.txt"
        answers.write_text(node_answers(*gpus))
        monkeypatch.setenv("FANRUN_NVML_LIBRARY", str(recorded_nvml))
        monkeypatch.setenv("FANRUN_RECORDED_NVML", str(answers))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        _accelerators._machine_gpus.cache_clear()
        reader.forget()
        return answers

    yield record
    _accelerators._machine_gpus.cache_clear()
    reader.forget()


def where_it_ran(marker_dir: str) -> dict:
    """Runs in each rank: says which GPUs it was given, without touching CUDA, and leaves a mark."""
    import os

    rank = os.environ["RANK"]
    open(os.path.join(marker_dir, f"rank_{rank}"), "w").close()
    return {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK")}


FAULTS = {
    "ecc": ({"ecc_uncorrected": "2"}, "2 uncorrectable ECC errors"),
    "remapped rows pending": ({"remapped_rows": "0 1 1 0"}, "memory rows wait to be remapped"),
    "remapping failed": ({"remapped_rows": "0 1 0 1"}, "a memory row could not be remapped"),
    "retired pages": ({"retired_pages_pending": "1"}, "memory pages wait to be retired"),
    "thermal": ({"throttle_reasons": "0x41"}, r"throttled \(HW thermal slowdown; reasons 0x41\)"),
    "power brake": ({"throttle_reasons": "0x88"}, r"HW slowdown, HW power brake"),
    "narrow link": ({"pcie": "5 5 8 16"}, "PCIe link runs at x8 of x16"),
    "slow link at work": ({"pcie": "3 5 16 16", "utilization": "90"}, "generation 3 of 5 while the GPU is busy"),
    "foreign process": ({"process": f"4242 {3 * GIB}"}, r"process 4242 holds 3.0 GiB on it"),
    "unseen memory": ({"memory": f"{141 * GIB} {20 * GIB}"}, r"20.0 GiB of its memory is in use by no process this one"),
}


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_an_unhealthy_gpu_stops_the_call_before_any_rank_starts(fault, node, tmp_path):
    changes, reason = FAULTS[fault]
    node(gpu_answers(0), gpu_answers(1, **changes))
    call = fanrun.distributed(num_accelerators=2, tracking=False)(where_it_ran)
    with pytest.raises(fanrun.GpuHealthError, match=rf"GPU 1 \({uuid(1)}, NVIDIA H200\) is unhealthy: .*{reason}") as raised:
        call.distributed(str(tmp_path))
    assert "No rank was started" in str(raised.value) and "exclude_unhealthy=True" in str(raised.value)
    assert [problem[:2] for problem in raised.value.problems] == [(1, uuid(1))]
    assert isinstance(raised.value, fanrun.AcceleratorMismatchError)
    assert not list(tmp_path.glob("rank_*")), "a rank ran"


def test_a_call_that_may_restart_is_not_restarted_for_an_unhealthy_gpu(node, tmp_path, capfd):
    node(gpu_answers(0, ecc_uncorrected="3"))
    call = fanrun.distributed(num_accelerators=1, tracking=False, max_restarts=2)(where_it_ran)
    with pytest.raises(fanrun.GpuHealthError):
        call.distributed(str(tmp_path))
    assert "attempt 1 of 3 failed" not in capfd.readouterr().err  # the GPU is as bad for every attempt
    assert not list(tmp_path.glob("rank_*")), "a rank ran"


def test_a_gpu_at_rest_on_a_lower_pcie_generation_is_healthy(node, tmp_path):
    # NVIDIA's GPUs lower their link's generation at rest to save power: only the width counts then.
    node(gpu_answers(0, pcie="1 5 16 16", utilization="0"))
    results = fanrun.distributed(num_accelerators=1, tracking=False)(where_it_ran).distributed(str(tmp_path))
    assert results[0]["RANK"] == "0" and results[0]["CUDA_VISIBLE_DEVICES"] is None


def test_healthy_recorded_gpus_run_the_call_on_every_one(node, tmp_path):
    node(gpu_answers(0), gpu_answers(1))
    results = fanrun.distributed(num_accelerators=2, tracking=False)(where_it_ran).distributed(str(tmp_path))
    assert [(r["RANK"], r["WORLD_SIZE"]) for r in results] == [("0", "2"), ("1", "2")]
    assert sorted(p.name for p in tmp_path.glob("rank_*")) == ["rank_0", "rank_1"]


def test_answers_a_gpu_does_not_support_are_not_judged(node, tmp_path):
    # An older GPU or driver: no ECC, no memory repair, no throttle reasons, no PCIe figures.
    node(gpu_answers(0, ecc_uncorrected="", retired_pages_pending="", remapped_rows="", throttle_reasons="", pcie=""))
    assert fanrun.distributed(num_accelerators=1, tracking=False)(where_it_ran).distributed(str(tmp_path))


def test_the_callers_own_process_on_its_gpu_is_not_another_job(node, tmp_path):
    # A notebook that initialised CUDA holds memory on the GPU its call then uses.
    node(gpu_answers(0, memory=f"{141 * GIB} {40 * GIB}", process=f"{os.getpid()} {39 * GIB}"))
    assert fanrun.distributed(num_accelerators=1, tracking=False)(where_it_ran).distributed(str(tmp_path))


def hold_memory_then_fail(answers: str, held_by_rank_0: str, directory: str) -> int:
    """Runs in each rank. On the first attempt rank 0 starts holding memory on its GPU, as a rank that
    used CUDA does (NVML now lists its pid there), and waits; rank 1 then fails. Returns the pid."""
    import os
    import threading
    import time

    rank, attempt = int(os.environ["RANK"]), int(os.environ["FANRUN_RESTART_COUNT"])
    held = os.path.join(directory, "held")
    if attempt == 0 and rank == 0:
        with open(answers + ".new", "w") as out:
            out.write(held_by_rank_0.format(pid=os.getpid()))
        os.replace(answers + ".new", answers)
        open(held, "w").close()
        threading.Event().wait()  # until the failed attempt is abandoned
    if attempt == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(held) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("rank 1 fails")
    return os.getpid()


def test_a_rank_kept_in_its_process_for_the_next_attempt_is_not_another_job_on_its_gpu(node, tmp_path):
    # Restarts that keep the processes: the survivor keeps its CUDA context, so NVML lists it on its
    # GPU when the next attempt's gate reads the GPUs. It is the call's own rank, not another job.
    answers = node(gpu_answers(0), gpu_answers(1))
    held_by_rank_0 = node_answers(gpu_answers(0, memory=f"{141 * GIB} {3 * GIB}", process=f"{{pid}} {2 * GIB}"),
                                  gpu_answers(1))
    call = fanrun.distributed(num_accelerators=2, max_restarts=1, tracking=False)(hold_memory_then_fail)
    results = call.distributed(str(answers), held_by_rank_0, str(tmp_path))
    first_pid = int(answers.read_text().split("process ")[1].split()[0])
    assert results[0] == first_pid, "rank 0 was not kept in its process"
    assert results[1] != first_pid


def test_exclude_unhealthy_runs_on_the_healthy_gpus_re_ranked(node, tmp_path, capfd):
    node(gpu_answers(0, ecc_uncorrected="1"), gpu_answers(1), gpu_answers(2))
    call = fanrun.distributed(num_accelerators=3, tracking=False, exclude_unhealthy=True)(where_it_ran)
    capfd.readouterr()
    results = call.distributed(str(tmp_path))
    visible = f"{uuid(1)},{uuid(2)}"
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["CUDA_VISIBLE_DEVICES"]) for r in results] == [
        ("0", "0", "2", visible), ("1", "1", "2", visible)]
    said = [line for line in capfd.readouterr().err.splitlines() if "left out as unhealthy" in line]
    assert len(said) == 1 and f"GPU 0 ({uuid(0)}): 1 uncorrectable ECC error" in said[0] and "GPUs 1, 2" in said[0]


def gpus_and_pid() -> tuple:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()


def test_a_rank_kept_alive_on_one_gpu_is_not_taken_for_a_call_left_on_another(node):
    answers = node(gpu_answers(0, ecc_uncorrected="1"), gpu_answers(1))
    call = fanrun.distributed(num_accelerators=2, keep_alive=True, exclude_unhealthy=True, tracking=False)(gpus_and_pid)
    try:
        [(first_gpus, first_pid)] = call.distributed()
        answers.write_text(gpu_answers(0) + gpu_answers(1, ecc_uncorrected="1"))
        reader.forget()  # the stand-in reads its answers as NVML starts
        [(second_gpus, second_pid)] = call.distributed()
    finally:
        fanrun.cooldown()
    assert (first_gpus, second_gpus) == (uuid(1), uuid(0))
    assert second_pid != first_pid


def test_the_deep_checks_figures_name_a_slow_gpu_against_its_model_its_peers_and_the_links():
    from fanrun._accelerators import Gpu
    from fanrun._health import deep

    def figures(tflops, tbps, bus=400.0):
        return {"bf16_tflops": tflops, "copy_tbps": tbps, "all_reduce_bus_gbps": bus}

    h200s = tuple(Gpu(index, "NVIDIA H200", uuid(index), 141 * GIB) for index in range(3))
    measured, problems = deep.judge(h200s, [figures(700, 4.3), figures(300, 4.2), figures(710, 1.0)])
    assert measured[1]["bf16_tflops"] == 300
    assert problems[0] == []
    assert problems[1] == [f"bf16 matrix products reach 300 TFLOP/s, below 50% of the 989 a H200 should: check its "
                           f"clocks and power (nvidia-smi -q -d PERFORMANCE) and what else runs on it"]
    assert len(problems[2]) == 1 and "TB/s, below 50% of the 4.8 a H200 should" in problems[2][0]
    # A model the table does not know is judged against its peers' median alone.
    unknown = tuple(Gpu(index, "NVIDIA Future X1", uuid(index), 80 * GIB) for index in range(3))
    _, problems = deep.judge(unknown, [figures(500, 2.0), figures(490, 2.1), figures(100, 2.0)])
    assert (problems[0], problems[1]) == ([], []) and "below 50% of the 490 that the node's GPUs reach" in problems[2][0]
    # A slow all-reduce names every GPU it ran over.
    _, problems = deep.judge(h200s, [figures(700, 4.3, 100.0)] * 3)
    assert all(len(found) == 1 and "an all-reduce over GPUs 0, 1, 2 reaches 100 GB/s" in found[0]
               for found in problems.values())


def test_exclude_unhealthy_with_no_healthy_gpu_is_an_error(node, tmp_path):
    node(gpu_answers(0, throttle_reasons="0x20"))
    call = fanrun.distributed(num_accelerators=1, tracking=False, exclude_unhealthy=True)(where_it_ran)
    with pytest.raises(fanrun.GpuHealthError, match="SW thermal slowdown(.|\n)*found no healthy GPU"):
        call.distributed(str(tmp_path))
    assert not list(tmp_path.glob("rank_*"))


def test_health_off_runs_on_an_unhealthy_gpu(node, tmp_path):
    node(gpu_answers(0, ecc_uncorrected="5"))
    assert fanrun.distributed(num_accelerators=1, tracking=False, health="off")(where_it_ran).distributed(str(tmp_path))


def test_a_node_that_shows_7_of_8_gpus_is_a_health_error(node):
    node(*(gpu_answers(i) for i in range(7)))
    with pytest.raises(fanrun.GpuHealthError, match=r"'GPU_8xH200' asks for 8 GPUs, and the driver shows 7 "
                       r"(.|\n)*fallen off the bus(.|\n)*'GPU_7xH200'"):
        fanrun.distributed(accelerator_type="GPU_8xH200", tracking=False)(where_it_ran).distributed("unused")


@pytest.mark.parametrize("options, error, message", [
    ({"health": "thorough"}, ValueError, "health must be 'cheap'.*not 'thorough'"),
    ({"health": True}, ValueError, "health must be 'cheap'.*not True"),
    ({"exclude_unhealthy": "yes"}, TypeError, "exclude_unhealthy must be True or False, not str"),
    ({"exclude_unhealthy": True, "health": None}, ValueError, "health='off' checks none"),
])
def test_bad_health_options_are_refused_at_decoration(options, error, message):
    with pytest.raises(error, match=message):
        fanrun.distributed(**options)


def test_the_deep_check_on_a_torch_without_cuda_says_it_cannot_run(node, tmp_path):
    node(gpu_answers(0))
    call = fanrun.distributed(num_accelerators=1, tracking=False, health="deep")(where_it_ran)
    with pytest.raises(fanrun.GpuHealthError, match="deep GPU health check could not run on GPUs 0 .*sees no CUDA GPU"):
        call.distributed(str(tmp_path))
    assert not list(tmp_path.glob("rank_*"))


def doctor(answers: Path, library: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FANRUN_NVML_LIBRARY": str(library), "FANRUN_RECORDED_NVML": str(answers)}
    return subprocess.run([sys.executable, "-m", "fanrun._cli.main", "doctor", *flags], env=env,
                          capture_output=True, text=True, timeout=120)


def test_doctor_prints_the_nodes_table_and_fails_for_an_unhealthy_gpu(node, recorded_nvml):
    answers = node(gpu_answers(0), gpu_answers(1, pcie="4 4 4 16"))
    done = doctor(answers, recorded_nvml)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["GPU", "UUID", "NAME"]
    row0 = next(line for line in lines if line.startswith("0 "))
    row1 = next(line for line in lines if line.startswith("1 "))
    assert uuid(0) in row0 and row0.rstrip().endswith("healthy")
    assert uuid(1) in row1 and "x4/x16" in row1 and "unhealthy" in row1
    assert "GPU 1: its PCIe link runs at x4 of x16" in done.stdout
    answers.write_text("driver 1\n" + gpu_answers(0) + gpu_answers(1))
    assert doctor(answers, recorded_nvml).returncode == 0


def test_doctor_json_holds_every_check(node, recorded_nvml):
    answers = node(gpu_answers(0, ecc_uncorrected="3"))
    done = doctor(answers, recorded_nvml, "--json")
    assert done.returncode == 1
    (gpu,) = json.loads(done.stdout)["gpus"]
    assert gpu["nvml_index"] == 0 and gpu["uuid"] == uuid(0) and gpu["reading"]["ecc_uncorrected_volatile"] == 3
    assert gpu["problems"] and "uncorrectable ECC" in gpu["problems"][0]


def test_fanrun_run_excludes_the_unhealthy_gpu_and_refuses_a_bad_level(node, recorded_nvml, tmp_path):
    answers = node(gpu_answers(0), gpu_answers(1, throttle_reasons="0x40"), gpu_answers(2))
    script = tmp_path / "where.py"
    script.write_text("import os\nprint('ran', os.environ['RANK'], os.environ['WORLD_SIZE'], "
                      "os.environ['CUDA_VISIBLE_DEVICES'])\n")
    env = {**os.environ, "FANRUN_NVML_LIBRARY": str(recorded_nvml), "FANRUN_RECORDED_NVML": str(answers)}
    fanrun_cli = [sys.executable, "-m", "fanrun._cli.main", "run"]
    done = subprocess.run([*fanrun_cli, "-n", "3", "--exclude-unhealthy", str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ran = sorted(line.split("ran ", 1)[1] for line in done.stdout.splitlines() if "ran " in line)
    assert ran == [f"0 2 {uuid(0)},{uuid(2)}", f"1 2 {uuid(0)},{uuid(2)}"]
    assert "HW thermal slowdown" in done.stderr
    stopped = subprocess.run([*fanrun_cli, "-n", "3", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 1 and "GpuHealthError: GPU 1" in stopped.stderr and "ran " not in stopped.stdout
    refused = subprocess.run([*fanrun_cli, "--health", "thorough", str(script)], env=env, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode != 0 and "--health must be 'cheap'" in refused.stderr


# MLflow's SQL store, on this SQLAlchemy, warns of its own use of a deprecated loader.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_each_gpus_verdict_goes_into_the_calls_mlflow_run(node, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("FANRUN_TRACKING", raising=False)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    node(gpu_answers(0, ecc_uncorrected="1"), gpu_answers(1))
    experiment = f"health-{os.getpid()}-{tmp_path.name}"
    call = fanrun.distributed(num_accelerators=2, exclude_unhealthy=True, experiment_name=experiment)(where_it_ran)
    call.distributed(str(tmp_path))
    fanrun.flush_tracking()
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])  # fanrun's own store, where the call made its run
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    params = run.data.params
    assert params["fanrun.health"] == "cheap" and params["fanrun.world_size"] == "1"
    assert params["fanrun.health.gpu_0"].startswith("1 uncorrectable ECC error")
    assert params["fanrun.health.gpu_1"] == "healthy"


# ---------------------------------------------------------------- on the GPU machine, real NVML


@needs_gpus(1)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_cheap_and_deep_checks_pass_on_real_gpus_and_their_figures_are_recorded(tmp_path, monkeypatch):
    MlflowClient = pytest.importorskip("mlflow").MlflowClient  # make test installs it; a bare GPU host may not

    monkeypatch.delenv("FANRUN_TRACKING", raising=False)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    experiment = f"health-gpu-{os.getpid()}"
    results = fanrun.distributed(health="deep", experiment_name=experiment)(where_it_ran).distributed(str(tmp_path))
    fanrun.flush_tracking()
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    for index in range(len(results)):
        assert run.data.params[f"fanrun.health.gpu_{index}"] == "healthy"
        assert run.data.metrics[f"fanrun.health.gpu_{index}.bf16_tflops"] > 0
        assert run.data.metrics[f"fanrun.health.gpu_{index}.copy_tbps"] > 0


@needs_gpus(1)
def test_doctor_deep_on_real_gpus_finds_them_healthy():
    done = subprocess.run([sys.executable, "-m", "fanrun._cli.main", "doctor", "--deep", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    gpus = json.loads(done.stdout)["gpus"]
    assert gpus and all(gpu["figures"]["bf16_tflops"] > 0 and not gpu["problems"] for gpu in gpus), done.stdout


def test_doctor_on_a_machine_without_gpu_says_there_is_nothing_to_check(tmp_path):
    no_nvml = tmp_path / "libfanrun-no-such-nvml.so"
    done = doctor(tmp_path / "none.txt", no_nvml)
    assert done.returncode == 0 and "there is no GPU to check here" in done.stderr, done.stderr
    deep = doctor(tmp_path / "none.txt", no_nvml, "--deep")
    assert deep.returncode == 2 and "the deep checks run CUDA work on GPUs" in deep.stderr, deep.stderr
