"""@distributed(nodes=...) on a real Ray cluster of two nodes (conftest.py): results and every rank's
environment, a rank failing on node 1 and one killed there, a node lost mid-call, the caller killed, a cluster too
small, a timeout on every node, metrics from every node, and ray_init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

import fanrun
from failure_plants import check_ddp_note, ddp_until_rank_1_raises
from cluster_stalls import CALL_TIMEOUT_S, STALL_TIMEOUT_S, Reports, Stopped, check_report, train_with_a_slow_loader
from processes import wait_gone
from rank_functions import log_where_node_1_cannot_see_the_store, on_two_nodes, save_where_node_1_sees_other_files

ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "FANRUN_NODE_ID")


def alive_node_ids() -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


@on_two_nodes()
def all_reduce_and_describe(x):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    return {**{name: os.environ.get(name) for name in ENVIRONMENT}, "sum": total.item(), "x": x}


def test_every_rank_of_every_node_returns_in_rank_order_with_its_place_in_the_cluster(cluster, capfd):
    results = all_reduce_and_describe.distributed(x=7)

    assert [r["RANK"] for r in results] == ["0", "1", "2", "3"]
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert [r["NODE_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert all(r["GROUP_RANK"] == r["NODE_RANK"] for r in results)
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) for r in results} == {("4", "2")}
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in results} == {("127.0.0.1", results[0]["MASTER_PORT"])}
    # Two distinct Ray nodes, ranks contiguous on each.
    node_ids = [r["FANRUN_NODE_ID"] for r in results]
    assert node_ids[0] == node_ids[1] != node_ids[2] == node_ids[3]
    assert set(node_ids) == alive_node_ids()
    assert {r["sum"] for r in results} == {6.0} and {r["x"] for r in results} == {7}
    out, err = capfd.readouterr()
    for rank in range(4):
        assert f"[rank{rank}]: hello from rank {rank}" in out
    assert "fanrun: 4 ranks on 2 Ray nodes: ranks 0-1 on node 0 (127.0.0.1), ranks 2-3 on node 1 (127.0.0.1)" in err


def test_backend_ray_without_nodes_runs_through_ray_on_one_node(cluster):
    @fanrun.distributed(num_accelerators=2, backend="ray", accelerator_type="CPU")
    def where():
        import os

        return os.environ["FANRUN_NODE_ID"], os.environ["GROUP_WORLD_SIZE"], os.environ["LOCAL_RANK"]

    results = where.distributed()
    assert [r[2] for r in results] == ["0", "1"] and {r[1] for r in results} == {"1"}
    assert len({r[0] for r in results}) == 1 and results[0][0] in alive_node_ids()


@on_two_nodes()
def raise_on_rank_2():
    import os
    import time

    if os.environ["RANK"] == "2":
        raise ValueError(f"raised at {time.time()!r}")
    time.sleep(120)  # the other ranks end only when fanrun stops them


def test_a_rank_failing_on_node_1_raises_its_own_exception_within_a_second_and_stops_every_rank(cluster):
    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        raise_on_rank_2.distributed()
    arrived = time.time()
    assert time.monotonic() - started < 60, "the ranks still sleeping were not stopped"
    raised = float(str(info.value).split("raised at ")[1])
    assert arrived - raised < 1.0
    assert str(info.value).startswith("[rank 2] raised at")
    note = " ".join(info.value.__notes__)
    assert "raised on rank 2 of 4" in note and "on node 1 (127.0.0.1)" in note
    # The rank's log came back to the caller's run directory, traceback included.
    log_path = note.split("full log: ")[1].strip()
    with open(log_path) as log:
        assert "ValueError: raised at" in log.read()


@on_two_nodes()
def all_reduce_until_rank_2_is_killed():
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(1000):
        dist.all_reduce(torch.ones(1000))
        if step == 20 and dist.get_rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_on_node_1_is_the_root_cause_not_its_peers_broken_collectives(cluster):
    # Its peers on node 0 fail at once with "connection reset by peer", and their news can reach
    # the caller before node 1's word of the death.
    with pytest.raises(fanrun.RankFailedError) as info:
        all_reduce_until_rank_2_is_killed.distributed()
    assert info.value.rank == 2 and info.value.signal_name == "SIGKILL", str(info.value)
    assert str(info.value).startswith("Rank 2 of 4 (pid"), str(info.value)


def test_a_peer_on_node_0_says_from_its_flight_recorder_where_it_waited_for_node_1s_failure(cluster, tmp_path):
    """Rank 1 raises on node 1 while rank 0 waits in DDP's gradient all-reduce on node 0: node 0's
    agent asks rank 0 before it stops it, and the caller's note names where it waited."""
    call = fanrun.distributed(num_accelerators=2, nodes=2, accelerator_type="CPU")(ddp_until_rank_1_raises)
    with pytest.raises(ValueError, match="bad batch") as info:
        call.distributed(str(tmp_path))
    check_ddp_note(info.value, tmp_path)


@fanrun.distributed(num_accelerators=6, nodes=3, accelerator_type="CPU")
def report_then_sleep(fifo):
    import os
    import time

    with open(fifo, "w") as ready:
        # The rank's pid and its keeper's.
        ready.write(f"{os.environ['RANK']} {os.environ['FANRUN_NODE_ID']} {os.getpid()} {os.getppid()}\n")
    time.sleep(120)


def test_a_node_removed_mid_call_is_named_and_the_other_nodes_ranks_are_stopped(cluster, tmp_path):
    victim = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDWR)  # never sees an end of file between two ranks' writes
    ranks_on, pids_on = {}, {}

    def remove_victim_once_all_run():
        with os.fdopen(reader, "r") as lines:
            for line in lines:
                rank, node_id, *pids = line.split()
                ranks_on.setdefault(node_id, []).append(int(rank))
                pids_on.setdefault(node_id, []).extend(map(int, pids))
                if sum(map(len, ranks_on.values())) == 6:
                    break
        cluster.remove_node(victim)

    remover = threading.Thread(target=remove_victim_once_all_run)
    remover.start()
    try:
        with pytest.raises(fanrun.NodeLostError) as info:
            report_then_sleep.distributed(str(fifo))
    finally:
        remover.join()
    error = info.value
    assert error.node_id == victim.node_id
    assert error.ranks == sorted(ranks_on[victim.node_id])
    assert f"node {error.node_rank} (127.0.0.1) was lost mid-call" in str(error)
    assert len(alive_node_ids()) == 2
    # The other nodes' ranks were stopped before the error came; the lost node's, and their
    # keepers, go with its agent, on their own clock.
    assert wait_gone(pids_on[victim.node_id], timeout=10) == []


def test_a_node_with_another_fanrun_is_named_before_any_rank_starts(cluster, tmp_path, runs_dir):
    # A node whose Python finds fanrun 0.0.1's metadata first, as a node with an older install would.
    metadata = tmp_path / "site" / "fanrun-0.0.1.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: fanrun\nVersion: 0.0.1\n")
    odd = cluster.add_node(num_cpus=2, env_vars={"PYTHONPATH": str(metadata.parent)})
    cluster.wait_for_nodes()
    runs_before = set(runs_dir.iterdir())
    try:
        with pytest.raises(fanrun.NodeEnvironmentError) as info:
            report_then_sleep.distributed("/nonexistent")
    finally:
        cluster.remove_node(odd)
    assert f"fanrun 0.0.1 (the caller has {fanrun.__version__})" in str(info.value)
    assert "host" in str(info.value) and "install the same ones there" in str(info.value)
    # The caller's run directory alone, without a rank's log: no node started anything.
    new = [path for path in set(runs_dir.iterdir()) - runs_before if "report_then_sleep" in path.name]
    assert len(new) == 1 and not list(new[0].glob("rank_*"))


CALLER = textwrap.dedent(
    """
    import sys
    import fanrun

    fanrun.ray_init(address=sys.argv[1])

    @fanrun.distributed(num_accelerators=4, nodes=2, accelerator_type="CPU")
    def wait_forever():
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])  # something the rank started itself
        print("pids", os.getpid(), child.pid, os.getppid(), flush=True)  # the rank, its child, its keeper
        time.sleep(300)

    try:
        wait_forever.distributed()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    """
)


def start_caller_and_its_ranks(cluster) -> tuple[subprocess.Popen, list[int]]:
    """A caller in a process of its own, once its 4 ranks and what each started are running; with
    the pids of the ranks, their children and their keepers."""
    caller = subprocess.Popen([sys.executable, "-c", CALLER, cluster.address], stdout=subprocess.PIPE, text=True)
    pids = []
    for line in caller.stdout:
        if "pids" in line:
            pids += [int(pid) for pid in line.split("pids", 1)[1].split()]
            if len(pids) == 12:
                break
    return caller, pids


def test_a_caller_killed_with_sigkill_leaves_no_rank_on_any_node(cluster):
    caller, pids = start_caller_and_its_ranks(cluster)
    try:
        assert len(pids) == 12
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        caller.stdout.close()
    assert wait_gone(pids, timeout=5) == []  # measured: 0.04-0.23 s


def test_ctrl_c_in_the_caller_stops_every_rank_on_every_node_then_raises_keyboard_interrupt(cluster):
    caller, pids = start_caller_and_its_ranks(cluster)
    try:
        assert len(pids) == 12
        caller.send_signal(signal.SIGINT)
        rest = caller.stdout.read()
        assert caller.wait(timeout=60) == 0
    finally:
        caller.kill()
        caller.wait()
        caller.stdout.close()
    assert "interrupted" in rest
    # Stopped before the exception reached the caller's code: nothing to wait for.
    assert wait_gone(pids, timeout=0) == []


@fanrun.distributed(num_accelerators=6, nodes=3, accelerator_type="CPU", placement_timeout=2)
def needs_three_nodes():
    return 1


def test_a_cluster_too_small_is_an_error_within_the_placement_timeout_saying_what_is_free(cluster):
    started = time.monotonic()
    with pytest.raises(fanrun.ClusterResourcesError) as info:
        needs_three_nodes.distributed()
    assert 2 <= time.monotonic() - started < 10
    assert "asked 3 nodes x 2 CPUs; free: 2 nodes with 2 CPUs" in str(info.value)


def test_gpus_asked_of_a_cluster_without_any_are_an_error_before_anything_starts(cluster):
    with pytest.raises(fanrun.AcceleratorMismatchError, match="the Ray cluster has none"):
        fanrun.distributed(num_accelerators=2, nodes=2, accelerator_type="GPU_1xH200")(lambda: 1).distributed()


@on_two_nodes(timeout=15)
def stuck_in_a_named_function():
    import time

    def waiting_for_ever():
        time.sleep(300)

    waiting_for_ever()


def test_a_timeout_dumps_the_stacks_of_every_rank_on_every_node(cluster):
    with pytest.raises(fanrun.RunTimeoutError) as info:
        stuck_in_a_named_function.distributed()
    assert sorted(info.value.stacks) == [0, 1, 2, 3], info.value.missing_stacks
    for lines in info.value.stacks.values():
        assert any("waiting_for_ever" in line for line in lines)


def test_a_stall_on_node_1_is_named_from_the_evidence_of_both_nodes(cluster, tmp_path):
    reports = Reports(tmp_path)
    call = on_two_nodes(timeout=CALL_TIMEOUT_S, stall_timeout=STALL_TIMEOUT_S, on_stall=reports)
    with pytest.raises(Stopped):
        call(train_with_a_slow_loader).distributed(str(tmp_path))
    check_report(reports, tmp_path)


NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="a rank's private view of a folder needs root (mount)")


@NEEDS_ROOT
def test_a_checkpoint_directory_that_a_node_does_not_share_is_a_clear_error(cluster, tmp_path):
    errors = save_where_node_1_sees_other_files.distributed(str(tmp_path))
    assert all(errors), errors
    for error in errors:
        assert "CheckpointNotSharedError" in error and "rank 2 (node 1) does not see the directory" in error
        assert "storage that every machine of the run shares" in error
    assert not (tmp_path / "step_1").exists()


@on_two_nodes()
def log_a_metric_per_rank():
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(3):
        mlflow.log_metric(f"steps/rank_{rank}", rank * 10 + step, step=step)
    return mlflow.active_run().info.run_id


def tracked_call_in_a_sqlite_store(monkeypatch, folder, call) -> tuple[MlflowClient, str]:
    """Runs `call` tracked, in a sqlite store in `folder`; (its client, the call's run id), once
    every rank's metric steps/rank_N (rank * 10 + step, steps 0-2) is in the store."""
    monkeypatch.delenv("FANRUN_TRACKING", raising=False)
    uri = f"sqlite:///{folder / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"ray-{folder.name}")
    try:
        run_ids = call()
        fanrun.flush_tracking()
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
    assert len(set(run_ids)) == 1
    client = MlflowClient(uri)
    for rank in range(4):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_ids[0], f"steps/rank_{rank}"))
        assert history == [(step, rank * 10 + step) for step in range(3)]
    return client, run_ids[0]


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # MLflow's own use of SQLAlchemy 2.1
def test_metrics_logged_on_every_node_reach_the_calls_run(cluster, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    client, run_id = tracked_call_in_a_sqlite_store(monkeypatch, tmp_path, log_a_metric_per_rank.distributed)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_the_ray_notebook_runs_in_a_real_kernel_on_two_nodes(cluster, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    examples = Path(__file__).resolve().parents[2] / "examples"
    sys.path.insert(0, str(examples))
    from notebook_format import notebook_of

    notebook = nbformat.read(examples / "ray_ddp.ipynb", as_version=4)
    script = notebook_of(examples / "ray_ddp.py")
    assert [(c.cell_type, c.source) for c in notebook.cells] == [(c.cell_type, c.source) for c in script.cells]
    # The kernel finds the cluster as a notebook on a cluster's machine does: through RAY_ADDRESS.
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = ["".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")
               for cell in notebook.cells if cell.cell_type == "code"]
    assert f"Ray cluster: {cluster.address}" in outputs[0]
    for rank in range(4):
        assert f"[rank{rank}]: node {rank // 2}: loss" in outputs[1]
    assert "4 ranks on 2 machines trained; the loss went down on every one." in outputs[2]


@NEEDS_ROOT
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # MLflow's own use of SQLAlchemy 2.1
def test_ranks_that_cannot_see_the_callers_sqlite_store_still_log_their_metrics_to_the_run(
        cluster, monkeypatch, tmp_path, capfd):
    store_folder = tmp_path / "unreachable-store"
    store_folder.mkdir()
    monkeypatch.chdir(tmp_path)
    client, run_id = tracked_call_in_a_sqlite_store(
        monkeypatch, store_folder, lambda: log_where_node_1_cannot_see_the_store.distributed(str(store_folder)))
    # Node 0 reached the store itself; node 1's parameters had nowhere to go, and the caller says so.
    params = client.get_run(run_id).data.params
    # Rank 1's param is under param_1/rank_1: what a rank other than 0 logs (docs/tracking.md's rule).
    assert params.get("param_0") == "0" and params.get("param_1/rank_1") == "1"
    assert not [key for key in params if key.startswith(("param_2", "param_3"))]
    assert "ranks on other machines cannot see this call's MLflow store" in capfd.readouterr().err


def test_ray_init_twice_returns_the_connected_clusters_address(cluster):
    assert fanrun.ray_init() == fanrun.ray_init(address=cluster.address) == cluster.address
    assert os.environ["RAY_ADDRESS"] == cluster.address
    with pytest.raises(RuntimeError, match="ray_shutdown"):
        fanrun.ray_init(address="127.0.0.1:1")
