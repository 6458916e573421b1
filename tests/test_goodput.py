"""The goodput ledger (_launch/goodput.py, docs/goodput.md): a call's wall time split into its parts,
which add up to the wall time measured around the call; the parts that the ranks' records time
(data waits, checkpoint stalls, restart downtime, steps lost); the ledger on the call's MLflow
run, over the attempts nested under it, and in the run's record, a detached run's included."""

from __future__ import annotations

import statistics
import time
import uuid

import pytest
from processes import wait_gone

import fanrun
from fanrun import distributed
from fanrun._launch import goodput, records
from fanrun._spec.progress_record import RankProgress

# MLflow's sqlite store uses SQLAlchemy options that SQLAlchemy 2.1 deprecates: not fanrun's to fix.
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")

SLEEP_S = 0.05  # each batch's fetch
STEPS = 12


@pytest.fixture
def store(monkeypatch, tmp_path):
    """Tracking on (conftest turns it off), into a sqlite store of the test's own, as test_tracking.py's are.
    mlflow is imported here, not by the module, which every rank imports to find train()."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("FANRUN_TRACKING", raising=False)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # MLflow's local defaults (mlruns/) are relative to it
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    name = f"fanrun-goodput-{uuid.uuid4().hex[:8]}"
    experiment_id = client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    return client, experiment_id


def train(directory: str, checkpoint_at: int, die_at: int | None = None):
    """STEPS steps of a small model, each over a batch that takes SLEEP_S to fetch and an
    all-reduce of its gradients; a checkpoint saved through VolumeWriter after step
    `checkpoint_at`; on the first attempt, rank 1 killed by SIGKILL after step `die_at`."""
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fanrun.data.checkpoint import VolumeWriter

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return STEPS

        def __getitem__(self, index):
            time.sleep(SLEEP_S)
            return torch.ones(1024)

    dist.init_process_group("gloo")
    first_attempt = os.environ["FANRUN_RESTART_COUNT"] == "0"
    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    save_s = 0.0
    for step, batch in enumerate(torch.utils.data.DataLoader(Slow(), batch_size=None), start=1):
        model(batch).sum().backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad()
        if step == checkpoint_at:
            started = time.time()
            dcp.save({"model": model.state_dict()}, storage_writer=VolumeWriter(os.path.join(directory, f"step-{step}")))
            save_s += time.time() - started
        if first_attempt and step == die_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    return os.environ["FANRUN_RUN_ID"], save_s


def ledger_of(run_id: str) -> goodput.Goodput:
    found = fanrun.Run(run_id).goodput
    assert found is not None, f"run {run_id}'s record keeps no goodput ledger"
    assert sum(found.parts.values()) == pytest.approx(found.wall_s, abs=1e-6)
    assert all(seconds >= 0 for seconds in found.parts.values()), found
    return found


def metrics_of(client, run) -> dict[str, float]:
    return {key: value for key, value in client.get_run(run.info.run_id).data.metrics.items()
            if key.startswith("fanrun/goodput/")}


def test_the_parts_add_up_to_the_wall_time_with_the_data_waits_and_the_checkpoint_stall(store, tmp_path, capfd):
    client, experiment_id = store
    started = time.time()
    results = distributed(num_accelerators=2)(train).distributed(str(tmp_path), checkpoint_at=6)
    wall_s = time.time() - started
    run_id, save_s = results[0][0], statistics.fmean(save_s for _, save_s in results)
    ledger = ledger_of(run_id)
    assert ledger.wall_s == pytest.approx(wall_s, rel=0.01)
    # Every batch's fetch is a wait for data, the first one's (before the first collective) too.
    assert STEPS * SLEEP_S <= ledger.parts["data"] < STEPS * SLEEP_S + 0.25, ledger
    assert ledger.parts["checkpoint"] == pytest.approx(save_s, rel=0.2, abs=0.02), (ledger, save_s)
    assert ledger.parts["steps"] > 0 and ledger.parts["start"] > 0 and ledger.steps_lost == 0
    assert ledger.attempts == 1 and ledger.observed and ledger.steps == STEPS
    _, err = capfd.readouterr()
    assert f"fanrun: {ledger.line()}\n" in err and ledger.line().startswith("goodput ")
    # Without restarts, the call's one run holds the ledger, as it was when the run closed.
    (run,) = client.search_runs([experiment_id])
    logged = metrics_of(client, run)
    assert set(logged) == {f"fanrun/goodput/{part}_s" for part in goodput.PARTS} | {
        f"fanrun/goodput/{name}" for name in ("fraction", "wall_s", "steps", "steps_lost", "attempts")}
    assert logged["fanrun/goodput/data_s"] == pytest.approx(ledger.parts["data"], abs=1e-6)
    assert logged["fanrun/goodput/wall_s"] <= ledger.wall_s


def test_a_rank_killed_after_a_checkpoint_costs_restart_downtime_and_the_steps_since_it(store, tmp_path, capfd):
    client, experiment_id = store
    checkpoint_at, die_at = 3, 8
    started = time.time()
    (run_id, _), _ = distributed(num_accelerators=2, max_restarts=1)(train).distributed(
        str(tmp_path), checkpoint_at=checkpoint_at, die_at=die_at)
    wall_s = time.time() - started
    ledger = ledger_of(run_id)
    assert ledger.wall_s == pytest.approx(wall_s, rel=0.01)
    assert ledger.steps_lost == die_at - checkpoint_at and ledger.attempts == 2 and ledger.steps == die_at + STEPS
    assert ledger.parts["restart"] > 0 and ledger.parts["steps"] > 0
    # Both attempts waited for all of their batches.
    assert (die_at + STEPS) * SLEEP_S <= ledger.parts["data"] < (die_at + STEPS) * SLEEP_S + 0.5, ledger
    _, err = capfd.readouterr()
    assert f", {die_at - checkpoint_at} steps lost\n" in err
    # The call's run holds the ledger; each attempt's run is nested under it.
    runs = {run.info.run_name: run for run in client.search_runs([experiment_id])}
    name = min(runs, key=len)
    assert sorted(runs) == [name, f"{name}-attempt-1", f"{name}-attempt-2"]
    logged = metrics_of(client, runs[name])
    assert logged["fanrun/goodput/steps_lost"] == die_at - checkpoint_at and logged["fanrun/goodput/restart_s"] > 0
    for number in (1, 2):
        attempt = runs[f"{name}-attempt-{number}"]
        assert attempt.data.tags["mlflow.parentRunId"] == runs[name].info.run_id
        assert metrics_of(client, attempt) == {}


def test_a_detached_run_keeps_its_ledger_over_its_attempts_in_its_record(store, tmp_path):
    client, experiment_id = store
    run = distributed(num_accelerators=2, max_restarts=1, detach=True)(train).distributed(
        str(tmp_path), checkpoint_at=2, die_at=4)
    (run_id, _), _ = run.result(timeout=120)
    assert run_id == run.id
    ledger = ledger_of(run.id)
    info = run.info
    assert ledger.wall_s <= info["ended"] - info["created"]
    assert ledger.attempts == 2 and ledger.steps_lost == 2 and ledger.parts["restart"] > 0
    assert records.RunRecord.find(run.id).read_bytes(goodput.FILE) == ledger.to_json()
    assert f"fanrun: {ledger.line()}\n" in run.logs()  # what `fanrun logs` and `fanrun attach` show
    # The runner's call is tracked as a blocking one is: its attempts nested under its run.
    runs = {found.info.run_name: found for found in client.search_runs([experiment_id])}
    name = min(runs, key=len)
    assert sorted(runs) == [name, f"{name}-attempt-1", f"{name}-attempt-2"]
    assert metrics_of(client, runs[name])["fanrun/goodput/steps_lost"] == 2
    assert all(runs[f"{name}-attempt-{n}"].data.tags["mlflow.parentRunId"] == runs[name].info.run_id for n in (1, 2))
    assert wait_gone([records.RunRecord.find(run.id).read_runner()["pid"]], timeout=10) == []


def marks(**values) -> RankProgress:
    """A rank's last progress record, as a rank that reached these marks writes it."""
    fields = dict(rank=0, state="compute", pid=1000, steps=0, batches=0, collectives=0, state_since=0.0,
                  progress_at=0.0, step_at=0.0, step_s=0.0, step_data_s=0.0, step_comm_s=0.0, data_s=0.0, comm_s=0.0,
                  op="")
    return RankProgress(**{**fields, **values})


def test_a_hang_that_a_timeout_ends_is_detection_and_the_next_attempt_is_restart_downtime():
    ledger = goodput.Ledger(started_at=100.0)
    ledger.attempt_started(100.5)
    ledger.locks_held(101.0)
    # No rank failed of itself: the attempt's last progress was at 115, and the call knew at 125.
    ledger.ranks_ended([marks(began_at=103.0, ready_at=105.0, ready_data_s=0.5, data_s=1.5, checkpoint_s=1.0,
                              steps=10, checkpoint_step=4, progress_at=115.0)], failure_seen_at=None)
    ledger.attempt_failed(at=125.0)
    ledger.attempt_started(126.0)
    ledger.locks_held(126.1)
    ledger.ranks_ended([marks(began_at=127.0, ready_at=128.0, ended_at=138.0, steps=5)])
    ledger.attempt_ended(139.0)
    result = ledger.close(at=140.0)
    assert result.parts == pytest.approx({"lock": 0.5, "start": 2.0, "setup": 1.5, "steps": 8.0 + 10.0, "data": 1.5,
                                          "checkpoint": 1.0, "detect": 10.0, "restart": 3.0, "other": 0.5 + 2.0})
    assert (result.wall_s, result.steps, result.steps_lost, result.attempts) == (40.0, 15, 6, 2)
    assert result.line() == ("goodput 45.0 % of 40.0 s: GPU wait 0.5 s, start 2.0 s, set-up 1.5 s, data 1.5 s, "
                             "checkpoint 1.0 s, detect 10.0 s, restart 3.0 s, other 2.5 s, 6 steps lost")
    assert goodput.Goodput.from_json(result.to_json()) == result
