"""Detached runs (@distributed(detach=True), _detached/): a call that goes on in a runner process of
its own, which another process of the same user finds again with its id, follows, cancels and
takes the outcome of."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import fanrun
from fanrun import distributed
from fanrun._launch import records
from gpus import needs_gpus
from processes import wait_gone


@distributed(num_accelerators=2, detach=True)
def steps(count, gate=None):
    import os
    import time
    from pathlib import Path

    while gate is not None and not Path(gate).exists():
        time.sleep(0.02)
    for step in range(count):
        print(f"step {step} of rank {os.environ['RANK']}", flush=True)
    return int(os.environ["RANK"]) + count


def runner_pid(run: fanrun.Run) -> int:
    return records.RunRecord.find(run.id).read_runner()["pid"]


def test_a_detached_call_returns_a_run_at_once_whose_result_is_the_ranks_values(tmp_path):
    gate = tmp_path / "gate"
    started = time.monotonic()
    run = steps.distributed(3, str(gate))
    assert isinstance(run, fanrun.Run) and time.monotonic() - started < 10
    assert run.status in ("QUEUED", "RUNNING")
    assert run.id in [r.id for r in fanrun.runs()]
    with pytest.raises(TimeoutError, match=r"is still (QUEUED|RUNNING): after 0.2 s"):
        run.result(timeout=0.2)
    gate.touch()
    assert run.result(timeout=60) == [3, 4]
    assert run.status == "FINISHED" and run.info["world_size"] == 2
    assert run.id not in [r.id for r in fanrun.runs()] and run.id in [r.id for r in fanrun.runs(all=True)]
    logs = run.logs()
    assert [line for line in logs.splitlines() if line.startswith("[rank1]")] == [
        f"[rank1]: step {step} of rank 1" for step in range(3)]
    assert run.logs(rank=0) == "".join(f"step {step} of rank 0\n" for step in range(3))
    assert wait_gone([runner_pid(run)], timeout=10) == []


SUBMITTER = """
import os, sys, time, fanrun

@fanrun.distributed(num_accelerators=2, detach=True)
def count(lines):
    import os, time
    for line in range(lines):
        print(f"line {line} of rank {os.environ['RANK']}", flush=True)
        time.sleep(0.02)
    return os.getpid()

print(count.distributed(60).id, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_run_outlives_its_submitter_killed_with_sigkill_and_attach_gives_all_of_it(tmp_path):
    submitter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SUBMITTER)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        run_id = submitter.stdout.readline().strip()
        assert run_id, submitter.stderr.read()
    finally:
        submitter.send_signal(signal.SIGKILL)
        submitter.communicate(timeout=30)
    attached = subprocess.run([sys.executable, "-m", "fanrun", "attach", run_id], capture_output=True, text=True,
                              timeout=120)
    assert attached.returncode == 0, attached.stderr
    for rank in (0, 1):
        lines = [line for line in attached.stdout.splitlines() if line.startswith(f"[rank{rank}]")]
        assert lines == [f"[rank{rank}]: line {line} of rank {rank}" for line in range(60)]
    assert f"run {run_id} FINISHED" in attached.stderr
    run = fanrun.Run(run_id)
    pids = run.result()
    assert len(pids) == 2 and wait_gone(pids + [runner_pid(run)], timeout=10) == []


@distributed(num_accelerators=2, detach=True)
def sleeps_after_saying_its_pid(directory):
    import os
    import time
    from pathlib import Path

    Path(directory, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(300)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def rank_pids(directory, count=2) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = sorted(directory.glob("rank*"))
        if len(files) == count and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("the ranks did not start")


def test_cancel_stops_every_rank_and_leaves_no_process(tmp_path):
    run = sleeps_after_saying_its_pid.distributed(str(tmp_path))
    ranks = rank_pids(tmp_path)
    runner = runner_pid(run)
    cancelled = subprocess.run([sys.executable, "-m", "fanrun", "cancel", run.id], capture_output=True, text=True,
                               timeout=60)
    assert cancelled.returncode == 0 and f"run {run.id} KILLED" in cancelled.stderr, cancelled.stderr
    assert wait_gone(ranks + [runner], timeout=10) == []
    assert run.status == "KILLED"
    with pytest.raises(fanrun.RunCancelledError, match="was cancelled"):
        run.result()
    assert "the run was cancelled; its ranks were stopped" in run.logs()


@distributed(num_accelerators=2, detach=True)
def rank_1_raises():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gave up")
    return 0


def test_a_failed_run_raises_what_a_blocking_call_would(tmp_path):
    run = rank_1_raises.distributed()
    with pytest.raises(ValueError, match="rank 1 gave up") as raised:
        run.result(timeout=60)
    assert isinstance(raised.value.__cause__, fanrun.RemoteTraceback)
    assert 'raise ValueError("rank 1 gave up")' in str(raised.value.__cause__)
    assert run.status == "FAILED" and run.info["reason"].startswith("ValueError")
    assert "rank 1 gave up" in run.logs()
    assert wait_gone([runner_pid(run)], timeout=10) == []


def test_a_runner_killed_with_sigkill_marks_its_run_failed_and_takes_its_ranks_along(tmp_path):
    run = sleeps_after_saying_its_pid.distributed(str(tmp_path))
    ranks = rank_pids(tmp_path)
    keepers = [parent_of(rank) for rank in ranks]  # each rank's fanrun-keeper, which ends after it
    runner = runner_pid(run)
    os.kill(runner, signal.SIGKILL)
    assert wait_gone([runner] + ranks + keepers, timeout=10) == []
    assert run.status == "FAILED"
    assert run.info["reason"] == f"its runner (pid {runner}) ended without recording an outcome"
    with pytest.raises(fanrun.FanrunError, match="ended FAILED without an outcome"):
        run.result()


def test_logs_follow_one_rank_from_a_shell(tmp_path):
    gate = tmp_path / "gate"
    run = steps.distributed(5, str(gate))
    follower = subprocess.Popen([sys.executable, "-m", "fanrun", "logs", run.id, "--rank", "1", "--follow"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gate.touch()
    out, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err
    assert out == "".join(f"step {step} of rank 1\n" for step in range(5))
    listed = subprocess.run([sys.executable, "-m", "fanrun", "list", "--all"], capture_output=True, text=True, timeout=60)
    assert [run.id, "FINISHED"] in [line.split()[:2] for line in listed.stdout.splitlines()], listed.stdout
    assert wait_gone([runner_pid(run)], timeout=10) == []


def test_bad_ids_and_options_are_named():
    with pytest.raises(fanrun.UnknownRunError, match="is not a run id"):
        fanrun.Run("../elsewhere")
    with pytest.raises(fanrun.UnknownRunError, match="no run f-20000101-000000-abcdef in"):
        fanrun.Run("f-20000101-000000-abcdef")
    with pytest.raises(TypeError, match="detach must be True or False"):
        distributed(detach="yes")
    with pytest.raises(ValueError, match="detach=True runs each call in a process of its own"):
        distributed(detach=True, keep_alive=True)


WORKLOAD = """\
experiment_name: detached-tests
function: job:train
kwargs: {{steps: 3}}
compute:
  num_accelerators: 2
max_retries: {retries}
env_variables: {{JOB_COLOUR: blue}}
"""

JOB = """\
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint


def train(steps):
    # The pattern docs/detached.md shows: every attempt resumes from the newest complete checkpoint.
    attempt = int(os.environ["FANRUN_RESTART_COUNT"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    initial = model.weight.detach().clone()
    state = {"model": model.state_dict(), "step": 0}
    if (last := latest_checkpoint("checkpoints")) is not None:  # None on the first attempt
        dcp.load(state, storage_reader=VolumeReader(last))
        model.load_state_dict(state["model"])
    start = state["step"]
    for step in range(start, steps):
        if attempt == 0 and step == 1 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), 9)  # the first attempt loses rank 1 midway
        with torch.no_grad():
            model.weight += 1.0
        state = {"model": model.state_dict(), "step": step + 1}
        dcp.save(state, storage_writer=VolumeWriter(f"checkpoints/step_{step}", keep_last=2))
    dist.destroy_process_group()
    added = float((model.weight - initial).mean())  # 1 per step, whichever attempt took it
    return [attempt, start, added, os.environ["JOB_COLOUR"], os.environ["TORCHELASTIC_RESTART_COUNT"]]
"""


def submit(tmp_path, *args, retries=1):
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "workload.yaml").write_text(WORKLOAD.format(retries=retries))
    return subprocess.run([sys.executable, "-m", "fanrun", "submit", str(tmp_path / "workload.yaml"), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_submit_retries_a_failed_attempt_which_resumes_from_the_latest_checkpoint(tmp_path):
    done = submit(tmp_path, "--watch")
    assert done.returncode == 0, done.stderr
    run = fanrun.Run(done.stdout.splitlines()[0])
    # The first attempt checkpointed step 0 before rank 1 was killed: the second took steps 1 and 2.
    assert run.result() == [[1, 1, 3.0, "blue", "1"], [1, 1, 3.0, "blue", "1"]]
    assert "attempt 1 of 2 failed (RankFailedError: Rank 1 of 2" in run.logs()
    assert wait_gone([runner_pid(run)], timeout=10) == []


def test_an_idempotency_key_returns_the_run_it_started_first(tmp_path):
    first = submit(tmp_path, "--idempotency-key", "nightly-1", retries=0)
    again = submit(tmp_path, "--idempotency-key", "nightly-1", retries=0)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert first.stdout == again.stdout
    run = fanrun.Run(first.stdout.strip())
    run.wait()
    assert run.status == "FAILED"  # no retry: rank 1's kill ends it
    with pytest.raises(fanrun.RankFailedError, match="Rank 1 of 2"):
        run.result()


@pytest.mark.parametrize(("text", "message"), [
    ("function: job:train\ncompute:\n  num_accelerators: two\n",
     "workload.yaml:3: compute.num_accelerators: must be a positive whole number, not 'two'"),
    ("function: job:train\nmax_retry: 2\n", "workload.yaml:2: max_retry: not a workload field"),
    ("command: python job.py\nscript: job.py\n",
     "workload.yaml:2: script: a workload runs one of command, script or function; this one gives command and script"),
    ("function: job:missing\n", "workload.yaml:1: function: 'job:missing' cannot be found"),
    ("script: nowhere.py\n", "workload.yaml:1: script: "),
    ("function: job:train\ncompute: {nodes: 0}\n", "workload.yaml:2: compute.nodes: must be a positive whole number of machines"),
])
def test_a_bad_workload_file_is_named_by_line_and_field_before_anything_starts(tmp_path, text, message):
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "workload.yaml").write_text(text)
    before = {record.id for record in records.all_records()}
    done = subprocess.run([sys.executable, "-m", "fanrun", "submit", "workload.yaml"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert {record.id for record in records.all_records()} == before


def test_dry_run_and_overrides(tmp_path):
    done = submit(tmp_path, "--dry-run", "--override", "compute.num_accelerators=1", "--override", "max_retries=3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("would run job:train(**{'steps': 3}) on 1 CPU process, max_retries 3, timeout none")
    bad = submit(tmp_path, "--override", "compute.num_accelerators=0")
    assert bad.returncode == 2 and "--override compute.num_accelerators: must be a positive whole number" in bad.stderr


@distributed(num_accelerators=2, max_restarts=1)
def dies_once():
    import os

    attempt = int(os.environ["FANRUN_RESTART_COUNT"])
    if attempt == 0 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), 9)
    with open("/proc/self/environ", "rb") as environ:  # as the process started: a spare's says so
        was_a_spare = b"FANRUN_SPARE_OF=" in environ.read()
    return attempt, was_a_spare


def test_a_restart_takes_ranks_started_while_the_first_attempt_ran(capfd):
    assert dies_once.distributed() == [(1, True), (1, True)]
    _, err = capfd.readouterr()
    assert "attempt 1 of 2 failed (RankFailedError: Rank 1 of 2" in err


@distributed(num_accelerators=1, detach=True)
def on_the_gpu(gate):
    import os
    import time

    while not os.path.exists(gate):
        time.sleep(0.02)
    return os.environ["LOCAL_RANK"]


@needs_gpus(1)
def test_a_run_whose_gpu_is_busy_waits_queued_and_starts_when_the_first_ends(tmp_path):
    first = on_the_gpu.distributed(str(tmp_path / "first"))
    deadline = time.monotonic() + 60
    while first.status != "RUNNING":
        assert time.monotonic() < deadline and first.status == "QUEUED", first.logs()
        time.sleep(0.05)
    second = on_the_gpu.distributed(str(tmp_path / "second"))
    (tmp_path / "second").touch()  # ready to go, but its GPU is the first run's
    assert second.wait(timeout=3) == "QUEUED"
    assert "is in use by 'on_the_gpu'" in second.logs()
    (tmp_path / "first").touch()
    assert first.result(timeout=60) == second.result(timeout=60) == ["0"]
    assert second.info["started"] >= first.info["ended"] - 0.5
