"""The Slurm backend on the local two-node cluster: a call from outside an allocation (srun asks
Slurm for the nodes, as from a login node), results and every rank's environment over 2 nodes x 2
CPU ranks, a rank on node 2 raising, a run directory that a node does not share, scancel mid-run,
and the caller killed with SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from cluster_stalls import (STALL_TIMEOUT_S, Reports, Stopped, check_report, check_straggler, ddp_with_a_slow_rank,
                            train_with_a_slow_loader)
from failure_plants import check_ddp_note, ddp_until_rank_1_raises
import recorded_nvml
from slurm_conf import FIRST_NODE_ADDRESS
from fanrun import GpuHealthError, NodeEnvironmentError, RunTimeoutError, distributed
from processes import wait_gone

CALL_TIMEOUT_S = 120.0


@pytest.fixture
def slurm(slurm_cluster, monkeypatch, tmp_path):
    """This process as a login node of the cluster: its clients' environment, and a runs root every
    node sees (they all run on this machine)."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("FANRUN_TRACKING", "0")
    yield slurm_cluster
    # A step's slurmstepd ends moments after its srun.
    assert wait_gone([pid for pid, _ in slurm_cluster.job_processes()], timeout=10) == []


def describe(tag):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    dist.destroy_process_group()
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "SLURMD_NODENAME")
    return {"tag": tag, "sum": total.item(), **{key: os.environ.get(key) for key in keys}}


def test_two_nodes_of_two_ranks_return_in_rank_order_with_each_ranks_environment(slurm):
    results = distributed(num_accelerators=4, nodes=2, backend="slurm", accelerator_type="CPU")(describe).distributed("x")
    assert [r["RANK"] for r in results] == ["0", "1", "2", "3"]
    assert {r["sum"] for r in results} == {6.0} and {r["tag"] for r in results} == {"x"}
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert [r["NODE_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert [r["SLURMD_NODENAME"] for r in results] == ["node1", "node1", "node2", "node2"]
    assert {r["WORLD_SIZE"] for r in results} == {"4"} and {r["LOCAL_WORLD_SIZE"] for r in results} == {"2"}
    assert {r["MASTER_ADDR"] for r in results} == {FIRST_NODE_ADDRESS}  # node1's NodeAddr, not its host's name


def fail_on_node_2():
    import os
    import time

    if os.environ["RANK"] == "3":
        raise KeyError("rank 3 has no such key")
    time.sleep(60)  # the others are stopped, not waited for


def test_a_rank_on_node_2_raising_reaches_the_caller_with_its_type_and_every_node_stops(slurm):
    started = time.monotonic()
    with pytest.raises(KeyError, match="rank 3 has no such key"):
        distributed(num_accelerators=4, nodes=2, backend="slurm", accelerator_type="CPU")(fail_on_node_2).distributed()
    assert time.monotonic() - started < 45


def test_a_peer_on_node_1_says_from_its_flight_recorder_where_it_waited_for_node_2s_failure(slurm, tmp_path):
    """Rank 1 raises on node 2 while rank 0 waits in DDP's gradient all-reduce on node 1: node 1's
    agent asks rank 0 before it stops it, and the caller's note names where it waited."""
    call = distributed(num_accelerators=2, nodes=2, backend="slurm", accelerator_type="CPU", timeout=CALL_TIMEOUT_S)
    with pytest.raises(ValueError, match="bad batch") as error:
        call(ddp_until_rank_1_raises).distributed(str(tmp_path))
    check_ddp_note(error.value, tmp_path)


def test_a_run_directory_a_node_does_not_share_is_named_before_any_rank_starts(slurm, monkeypatch):
    # node2 sees an empty file system of its own there (cluster.py)
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(slurm.unshared / "runs"))
    with pytest.raises(NodeEnvironmentError, match=r"is not on storage that node 1 \(node2, .*FANRUN_RUNS_DIR"):
        distributed(num_accelerators=2, nodes=2, backend="slurm", accelerator_type="CPU")(describe).distributed("x")


SLEEPER = """
import os, sys, time
from fanrun import distributed

def sleep():
    import os, time
    print("up", os.getpid(), flush=True)
    time.sleep(300)

try:
    distributed(num_accelerators=2, nodes=2, backend="slurm", accelerator_type="CPU")(sleep).distributed()
except Exception as error:
    print("raised", type(error).__name__, error, flush=True)
"""


def start_sleeper(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SLEEPER)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    ranks = []
    while len(ranks) < 2:
        line = caller.stdout.readline()
        assert line, caller.stderr.read()
        if "up " in line:
            ranks.append(int(line.split()[-1]))
    return caller, ranks


def test_scancel_mid_run_names_the_lost_node_and_leaves_no_rank(slurm, tmp_path):
    caller, ranks = start_sleeper(tmp_path)
    try:
        jobs = slurm.run(["squeue", "--noheader", "--format=%i"]).stdout.split()
        assert len(jobs) == 1, jobs
        slurm.run(["scancel", jobs[0]])
        out, err = caller.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        caller.kill()
    assert "raised NodeLostError" in out and "Slurm stopped its agent and ranks with SIGTERM" in out, out + err
    assert re.search(r"node \d \(\S+\) was lost mid-call \(Slurm node node[12], host ", out), out
    assert wait_gone(ranks, timeout=10) == []


def test_ctrl_c_in_the_caller_stops_every_rank_on_every_node(slurm, tmp_path):
    caller, ranks = start_sleeper(tmp_path)
    try:
        caller.send_signal(signal.SIGINT)
        out, err = caller.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        caller.kill()
    assert "KeyboardInterrupt" in err, out + err
    assert wait_gone(ranks, timeout=10) == []


def test_the_caller_killed_with_sigkill_leaves_no_process_on_any_node(slurm, tmp_path):
    caller, ranks = start_sleeper(tmp_path)
    caller.kill()
    caller.communicate(timeout=30)
    assert wait_gone(ranks, timeout=30) == []
    deadline = time.monotonic() + 30
    while slurm.job_processes() and time.monotonic() < deadline:
        time.sleep(0.2)  # slurmstepd ends the step once srun is gone
    assert slurm.job_processes() == []


IN_ALLOCATION = """
import json, os
from fanrun import distributed

def where():
    import os
    return os.environ["RANK"], os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]

print(json.dumps(distributed(nodes=2, accelerator_type="CPU")(where).distributed()), flush=True)
"""


def test_a_call_inside_salloc_runs_on_its_allocation_with_nodes_alone(slurm, tmp_path):
    done = slurm.run(["salloc", "--nodes=2", sys.executable, "-c", textwrap.dedent(IN_ALLOCATION)], cwd=tmp_path,
                     env={**slurm.env, **_fanrun_env()})
    assert done.returncode == 0, done.stderr
    granted = re.search(r"Granted job allocation (\d+)", done.stderr)
    ranks = json.loads(done.stdout.strip().splitlines()[-1])
    # 2 CPU processes a node by default, each a step of the allocation salloc was granted.
    assert ranks == [["0", "node1", granted[1]], ["1", "node1", granted[1]], ["2", "node2", granted[1]],
                     ["3", "node2", granted[1]]], done.stderr


def test_the_cli_in_an_sbatch_job_runs_the_script_on_both_nodes(slurm, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'on', "
                      "os.environ['SLURMD_NODENAME'], flush=True)\n")
    output = tmp_path / "job.out"
    done = slurm.run(["sbatch", "--wait", "--nodes=2", f"--output={output}", "--wrap",
                      f"{sys.executable} -m fanrun run --nodes 2 -n 1 {script}"], cwd=tmp_path,
                     env={**slurm.env, **_fanrun_env()})
    assert done.returncode == 0, done.stderr + output.read_text()
    lines = output.read_text().splitlines()
    assert "[rank0]: rank 0 of 2 on node1" in lines and "[rank1]: rank 1 of 2 on node2" in lines, lines


def _fanrun_env() -> dict[str, str]:
    return {key: os.environ[key] for key in ("FANRUN_RUNS_DIR", "FANRUN_TRACKING")}


def print_long_lines():
    import os
    import time

    rank = os.environ["RANK"]
    for index in range(LONG_LINES):
        print(f"{rank}:{index}:" + rank * 3000, flush=True)
        time.sleep(0.01)  # every node's agent sends its news for a few seconds, all at once
    return rank


LONG_LINES = 300


def test_long_lines_from_every_node_at_once_reach_the_caller_whole(slurm, capfd):
    """srun cuts a line longer than 1 KB and mixes its pieces with other nodes': each node's news
    goes in shorter lines, or it could not be read (and the call would hang or fail)."""
    call = distributed(num_accelerators=4, nodes=2, backend="slurm", accelerator_type="CPU", timeout=CALL_TIMEOUT_S,
                       display="logs")
    assert call(print_long_lines).distributed() == ["0", "1", "2", "3"]
    out = capfd.readouterr().out
    missing = [(rank, index) for rank in range(4) for index in range(LONG_LINES)
               if f"{rank}:{index}:{str(rank) * 3000}\n" not in out]
    assert missing == []


def stuck_in_a_named_function():
    import time

    def waiting_for_ever():
        time.sleep(300)

    waiting_for_ever()


def test_a_timeout_dumps_the_stacks_of_every_rank_on_every_node(slurm):
    call = distributed(num_accelerators=4, nodes=2, backend="slurm", accelerator_type="CPU", timeout=15)
    with pytest.raises(RunTimeoutError) as info:
        call(stuck_in_a_named_function).distributed()
    assert sorted(info.value.stacks) == [0, 1, 2, 3], info.value.missing_stacks
    for lines in info.value.stacks.values():
        assert any("waiting_for_ever" in line for line in lines)


def test_a_stall_on_node_2_is_named_from_the_evidence_of_both_nodes(slurm, tmp_path):
    reports = Reports(tmp_path)
    call = distributed(num_accelerators=4, nodes=2, backend="slurm", accelerator_type="CPU", timeout=CALL_TIMEOUT_S,
                       stall_timeout=STALL_TIMEOUT_S, on_stall=reports)
    with pytest.raises(Stopped):
        call(train_with_a_slow_loader).distributed(str(tmp_path))
    check_report(reports, tmp_path)


def test_a_straggler_on_node_2_under_ddp_is_flagged_from_both_nodes_flight_recorders(slurm, capfd):
    call = distributed(num_accelerators=2, nodes=2, backend="slurm", accelerator_type="CPU", timeout=CALL_TIMEOUT_S,
                       display="logs")
    assert call(ddp_with_a_slow_rank).distributed(100, 0.05) == [0, 1]
    check_straggler(capfd.readouterr().err, 1)


def gpu_place(marks):
    import os
    from pathlib import Path

    Path(marks, os.environ["RANK"]).touch()
    return os.environ["LOCAL_RANK"], os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def recorded_gpus(slurm, tmp_path, monkeypatch):
    """Each node's GPUs as the health gate reads them: NVML's recorded answers (the gate's seam),
    at one path, under the folder the second node does not share, so that each node has its own."""
    monkeypatch.setenv("FANRUN_NVML_LIBRARY", str(recorded_nvml.build(tmp_path)))
    answers = slurm.unshared / f"nvml-answers-{tmp_path.name}.txt"
    monkeypatch.setenv("FANRUN_RECORDED_NVML", str(answers))

    def record(first: str, second: str) -> None:
        answers.write_text(first)
        slurm.as_the_last_node_sees(answers).write_text(second)

    yield record
    for path in (answers, slurm.as_the_last_node_sees(answers)):
        path.unlink(missing_ok=True)


def test_healthy_gpus_on_both_nodes_run_a_gpu_call_there(recorded_gpus, tmp_path):
    healthy = recorded_nvml.node_answers(recorded_nvml.gpu_answers(0), recorded_nvml.gpu_answers(1))
    recorded_gpus(healthy, healthy)
    places = distributed(nodes=2, backend="slurm", slurm={"gres": "gpu:2"}, timeout=CALL_TIMEOUT_S)(gpu_place)
    assert [local for local, _ in places.distributed(str(tmp_path))] == ["0", "1", "0", "1"]
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.isdigit()) == ["0", "1", "2", "3"]


def run_id_on_a_gpu():
    import os

    import mlflow

    return os.environ.get("CUDA_VISIBLE_DEVICES"), mlflow.active_run().info.run_id


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # MLflow's own use of SQLAlchemy 2.1
def test_each_nodes_gpu_verdicts_go_into_the_calls_mlflow_run(recorded_gpus, monkeypatch, tmp_path):
    from mlflow import MlflowClient

    import fanrun

    healthy = recorded_nvml.node_answers(recorded_nvml.gpu_answers(0), recorded_nvml.gpu_answers(1))
    recorded_gpus(healthy, healthy)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FANRUN_TRACKING")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    try:
        ranks = distributed(nodes=2, backend="slurm", slurm={"gres": "gpu:2"},
                            timeout=CALL_TIMEOUT_S)(run_id_on_a_gpu).distributed()
        fanrun.flush_tracking()
    finally:
        fanrun._tracking.agent_connection.shutdown(wait_s=60)  # as in the MLflow test below
    (run_id,) = {run_id for _, run_id in ranks}
    params = MlflowClient(uri).get_run(run_id).data.params
    verdicts = {key: value for key, value in params.items() if key.startswith("fanrun.health")}
    assert verdicts == {"fanrun.health": "cheap", **{f"fanrun.health.node_{node}.gpu_{gpu}": "healthy"
                                                     for node in (0, 1) for gpu in (0, 1)}}


def test_an_unhealthy_gpu_on_node_2_stops_the_call_before_any_rank_starts_on_either_node(recorded_gpus, tmp_path):
    gpus = recorded_nvml.gpu_answers
    recorded_gpus(recorded_nvml.node_answers(gpus(0), gpus(1)),
                  recorded_nvml.node_answers(gpus(0), gpus(1, ecc_uncorrected="2")))
    marks = tmp_path / "marks"
    marks.mkdir()
    call = distributed(nodes=2, backend="slurm", slurm={"gres": "gpu:2"}, timeout=CALL_TIMEOUT_S)
    with pytest.raises(GpuHealthError) as info:
        call(gpu_place).distributed(str(marks))
    message = str(info.value)
    assert f"node 1 (node2, host {socket.gethostname()}): GPU 1 ({recorded_nvml.uuid(1)}, NVIDIA H200) is unhealthy: " \
           f"2 uncorrectable ECC errors" in message, message
    assert "node 0" not in message and "No rank was started on any node" in message and "exclude" in message
    assert [(index, gpu_uuid) for index, gpu_uuid, _ in info.value.problems] == [(1, recorded_nvml.uuid(1))]
    assert list(marks.iterdir()) == []


def test_what_the_gate_cannot_do_on_nodes_is_refused_before_anything_starts(slurm):
    for options, words in (({"health": "deep"}, "health='deep' runs its work on this machine's GPUs"),
                           ({"exclude_unhealthy": True}, "exclude_unhealthy=True re-ranks one machine's")):
        with pytest.raises(ValueError, match=re.escape(words)):
            distributed(nodes=2, backend="slurm", slurm={"gres": "gpu:2"}, **options)(gpu_place).distributed(".")


def log_a_metric_per_rank():
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(3):
        mlflow.log_metric(f"steps/rank_{rank}", rank * 10 + step, step=step)
    return mlflow.active_run().info.run_id


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # MLflow's own use of SQLAlchemy 2.1
def test_every_nodes_ranks_log_to_the_calls_one_mlflow_run(slurm, monkeypatch, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    import fanrun

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FANRUN_TRACKING")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "slurm")
    try:
        run_ids = distributed(num_accelerators=4, nodes=2, backend="slurm",
                              accelerator_type="CPU")(log_a_metric_per_rank).distributed()
        fanrun.flush_tracking()
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        # The caller's tracking agent lives as long as its caller, with the cluster's mark in its
        # environment (the fixture's): it ends here, not with the session.
        fanrun._tracking.agent_connection.shutdown(wait_s=60)
    assert len(set(run_ids)) == 1
    client = MlflowClient(uri)
    for rank in range(4):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_ids[0], f"steps/rank_{rank}"))
        assert history == [(step, rank * 10 + step) for step in range(3)]
    assert client.get_run(run_ids[0]).info.status == "FINISHED"


WORKLOAD = """
command: python train.py
compute: {nodes: 2, num_accelerators: 2, accelerator_type: CPU, backend: slurm, slurm: {job_name: submitted}}
"""


def test_a_submitted_workload_with_backend_slurm_runs_detached_on_both_nodes(slurm, tmp_path):
    (tmp_path / "train.py").write_text("import os\nprint('rank', os.environ['RANK'], 'on', os.environ['SLURMD_NODENAME'], "
                                       "os.environ['SLURM_JOB_NAME'], flush=True)\n")
    (tmp_path / "workload.yaml").write_text(WORKLOAD)
    done = subprocess.run([sys.executable, "-m", "fanrun", "submit", "--watch", str(tmp_path / "workload.yaml")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=CALL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 on node1 submitted" in done.stdout and "rank 1 on node2 submitted" in done.stdout, done.stdout


def test_a_detached_call_with_backend_slurm_hands_back_a_run_whose_result_is_every_ranks(slurm):
    run = distributed(num_accelerators=4, nodes=2, backend="slurm", accelerator_type="CPU",
                      detach=True)(describe).distributed("detached")
    results = run.result(timeout=CALL_TIMEOUT_S)
    assert [r["SLURMD_NODENAME"] for r in results] == ["node1", "node1", "node2", "node2"]
    assert {r["tag"] for r in results} == {"detached"} and run.status == "FINISHED"
