"""`fanrun submit` of a workload with compute.nodes: 2, run as a job of the Ray cluster's own job
system (conftest.py's cluster, its dashboard serving Ray Jobs): results, logs by rank, a cancel that
stops every rank, and the same run found again from another process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import fanrun
from fanrun._launch import records
from processes import wait_gone

JOB = textwrap.dedent('''
    import os
    import time
    from pathlib import Path


    def train(steps, gate=None, pids=None):
        rank = os.environ["RANK"]
        if pids:
            Path(pids, rank).write_text(str(os.getpid()))
        for step in range(steps):
            print(f"step {step} of rank {rank} on node {os.environ['NODE_RANK']}", flush=True)
        while gate is not None and not os.path.exists(gate):
            time.sleep(0.05)
        return [int(rank), os.environ["JOB_COLOUR"]]
''')

WORKLOAD = """function: job:train
kwargs: {{steps: 2{more}}}
compute: {{num_accelerators: 4, nodes: 2, accelerator_type: CPU}}
env_variables: {{JOB_COLOUR: green}}
"""


def submit(folder, *args, more=""):
    (folder / "job.py").write_text(JOB)
    (folder / "workload.yaml").write_text(WORKLOAD.format(more=more))
    return subprocess.run([sys.executable, "-m", "fanrun", "submit", "workload.yaml", *args],
                          capture_output=True, text=True, timeout=180, cwd=folder)


def test_a_two_node_workload_runs_as_a_ray_job_and_gives_its_results(cluster, jobs_address, tmp_path):
    done = submit(tmp_path, "--watch", "--ray-address", jobs_address)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = done.stdout.splitlines()[0]
    for rank, node in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert f"[rank{rank}]: step 1 of rank {rank} on node {node}" in done.stdout
    assert "fanrun-outcome" not in done.stdout
    assert f"fanrun: run {run_id} FINISHED" in done.stderr
    # Another process finds it by its id, as the submitting one has ended.
    run = fanrun.Run(run_id)
    assert run.status == "FINISHED" and run.info["ray_job"] == {"address": jobs_address}
    assert run.result() == [[rank, "green"] for rank in range(4)]
    assert run.logs(rank=2) == "step 0 of rank 2 on node 1\nstep 1 of rank 2 on node 1\n"
    listed = subprocess.run([sys.executable, "-m", "fanrun", "list", "--all"], capture_output=True, text=True, timeout=60)
    assert [run_id, "FINISHED"] in [line.split()[:2] for line in listed.stdout.splitlines()], listed.stdout


def test_cancelling_a_ray_job_stops_every_rank_on_every_node(cluster, jobs_address, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    more = f", gate: {str(tmp_path / 'never')!r}, pids: {str(pids)!r}"
    done = submit(tmp_path, "--ray-address", jobs_address, more=more)
    assert done.returncode == 0, done.stderr
    run = fanrun.Run(done.stdout.strip())
    attach = subprocess.Popen([sys.executable, "-m", "fanrun", "attach", run.id], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(os.listdir(pids)) == 4, run)
        rank_pids = [int((pids / name).read_text()) for name in sorted(os.listdir(pids))]
        cancelled = subprocess.run([sys.executable, "-m", "fanrun", "cancel", run.id], capture_output=True, text=True,
                                   timeout=120)
        assert cancelled.returncode == 0 and f"run {run.id} KILLED" in cancelled.stderr, cancelled.stderr
        out, err = attach.communicate(timeout=60)
    finally:
        attach.kill()
        attach.wait()
    assert attach.returncode == 130, err
    assert "[rank3]: step 1 of rank 3 on node 1" in out
    assert wait_gone(rank_pids, timeout=30) == []
    with pytest.raises(fanrun.RunCancelledError):
        run.result()


def wait_until(ready, run, timeout: float = 120.0) -> None:
    """Until ready(), while the run has not ended: the ranks write their files once the job has started them."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, run.logs()
        assert run.status in ("QUEUED", "RUNNING"), run.logs()
        time.sleep(0.2)


def test_a_two_node_workload_without_a_cluster_address_is_refused_before_anything_starts(tmp_path, monkeypatch):
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    before = {record.id for record in records.all_records()}
    done = submit(tmp_path)
    assert done.returncode == 2
    assert "compute.nodes: 2 runs as a job of a Ray cluster: pass --ray-address http://HEAD:8265" in done.stderr
    assert {record.id for record in records.all_records()} == before
