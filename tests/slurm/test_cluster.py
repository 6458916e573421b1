"""The local Slurm cluster is a real one: steps run one task on each of its two nodes, a batch job
writes its output and passes on its exit status, an allocation's steps reach both nodes, and a
cancelled job's processes end on both."""

from __future__ import annotations

import os
import re
import select
import shlex
import signal
import socket
import time

from processes import alive, wait_gone

TASK_START_TIMEOUT_S = 60.0
TASK_END_TIMEOUT_S = 30.0


def test_a_step_on_two_nodes_runs_one_task_on_each(slurm_cluster):
    done = slurm_cluster.run(["srun", "--nodes=2", "--ntasks-per-node=1",
                              "sh", "-c", "echo $SLURM_PROCID $SLURMD_NODENAME $(hostname)"])
    assert done.returncode == 0, done.stderr
    host = socket.gethostname()
    assert sorted(done.stdout.splitlines()) == [f"0 node1 {host}", f"1 node2 {host}"], done.stderr


def test_a_batch_job_waited_for_writes_its_output_file(slurm_cluster, tmp_path):
    output = tmp_path / "job.out"
    done = slurm_cluster.run(["sbatch", "--wait", "--nodes=2", f"--output={output}",
                              "--wrap", "srun --ntasks-per-node=1 printenv SLURMD_NODENAME"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"Submitted batch job \d+\n", done.stdout)
    assert sorted(output.read_text().split()) == ["node1", "node2"]


def test_sbatch_wait_exits_with_the_batch_jobs_status(slurm_cluster, tmp_path):
    done = slurm_cluster.run(["sbatch", "--wait", "--output=/dev/null", "--wrap", "exit 3"], cwd=tmp_path)
    assert done.returncode == 3, done.stderr


def test_an_allocation_of_two_nodes_runs_its_steps_on_both(slurm_cluster):
    done = slurm_cluster.run(["salloc", "--nodes=2", "srun", "--ntasks-per-node=1",
                              "sh", "-c", "echo $SLURM_JOB_ID $SLURMD_NODENAME"])
    assert done.returncode == 0, done.stderr
    granted = re.search(r"Granted job allocation (\d+)", done.stderr)
    assert granted, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"{granted[1]} node1", f"{granted[1]} node2"], done.stderr


def test_cancelling_a_running_job_ends_its_processes_on_both_nodes(slurm_cluster, tmp_path):
    started = tmp_path / "started"
    os.mkfifo(started)
    # Held open for writing here too: reading then waits for both tasks' lines, and never meets
    # an end of file between one task's and the other's.
    fifo = os.open(started, os.O_RDWR)
    try:
        task = f"echo $SLURMD_NODENAME $$ > {shlex.quote(str(started))}; exec sleep 300"
        submitted = slurm_cluster.run(["sbatch", "--parsable", "--nodes=2", "--output=/dev/null",
                                       "--wrap", f"srun --ntasks-per-node=1 sh -c {shlex.quote(task)}"], cwd=tmp_path)
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip()
        tasks = dict(line.split() for line in read_lines(fifo, 2, TASK_START_TIMEOUT_S))
    finally:
        os.close(fifo)
    assert sorted(tasks) == ["node1", "node2"]
    pids = [int(pid) for pid in tasks.values()]
    assert all(alive(pid) for pid in pids)
    assert set(pids) <= {pid for pid, _ in slurm_cluster.job_processes()}
    assert job_field(slurm_cluster, job, "JobState") == "RUNNING"

    cancelled = slurm_cluster.run(["scancel", job])
    assert cancelled.returncode == 0, cancelled.stderr
    assert wait_gone(pids, TASK_END_TIMEOUT_S) == []
    # The batch script, its srun and both nodes' slurmstepd end with the tasks.
    assert wait_gone([pid for pid, _ in slurm_cluster.job_processes()], TASK_END_TIMEOUT_S) == []
    assert slurm_cluster.job_processes() == []
    # Its batch script ended by SIGTERM, scancel's (its state may read COMPLETING a moment longer).
    assert job_field(slurm_cluster, job, "ExitCode") == f"0:{signal.SIGTERM.value}"


def job_field(cluster, job: str, name: str) -> str:
    shown = cluster.run(["scontrol", "--oneliner", "show", "job", job])
    assert shown.returncode == 0, shown.stderr
    field = re.search(rf"\b{name}=(\S+)", shown.stdout)
    assert field, shown.stdout
    return field[1]


def read_lines(fd: int, count: int, timeout: float) -> list[str]:
    """The first `count` lines written to `fd`, waited for up to `timeout`."""
    deadline = time.monotonic() + timeout
    data = b""
    while data.count(b"\n") < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise AssertionError(f"{count} lines not written within {timeout:g} s: {data!r}")
        data += os.read(fd, 4096)
    return data.decode().splitlines()
