"""Every .distributed() call is an MLflow run that all ranks log to: real MLflow, against a local
sqlite store and a real `mlflow server`, read back through MlflowClient."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import stat
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from gpus import needs_gpus
from mlflow_server import MlflowServer, SlowProxy
from processes import processes_of_runs_under, processes_with_environment, tracking_agents_of, wait_gone
from server_process import free_port

import fanrun
from fanrun import distributed
from fanrun._tracking.system_metrics import SystemMetricsSampler
from fanrun._tracking.links import TrackedRun, link_html, link_text
from fanrun import TrackingWarning
from fanrun._tracking.caller import outcome
from fanrun.backends.local.spares import POOL

mlflow = pytest.importorskip("mlflow")
MlflowClient = mlflow.MlflowClient
# MLflow's sqlite store uses SQLAlchemy options that SQLAlchemy 2.1 deprecates: not fanrun's to fix.
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")

HOST_METRICS = {
    "system/cpu_utilization_percentage",
    "system/system_memory_usage_megabytes",
    "system/system_memory_usage_percentage",
}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def tracking_on(monkeypatch, tmp_path):
    # conftest turns tracking off for the rest of the suite; these tests are about it.
    monkeypatch.delenv("FANRUN_TRACKING", raising=False)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    # MLflow's local defaults (mlflow.db, mlruns/) are relative to the working directory.
    monkeypatch.chdir(tmp_path)
    yield
    while mlflow.active_run() is not None:  # a failed test must not leave a parent run behind
        mlflow.end_run()


@pytest.fixture(scope="session")
def sqlite_uri(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("mlflow-sqlite")
    uri = f"sqlite:///{directory / 'store.db'}"
    # MLflow builds the store once per URI and resolves its default artifact root, ./mlruns,
    # against the working directory of that moment: let it be this folder, not the checkout.
    previous = os.getcwd()
    os.chdir(directory)
    try:
        MlflowClient(uri).search_experiments()  # creates the schema once (seconds), not in every test
    finally:
        os.chdir(previous)
    return uri


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    yield server
    server.stop()


def use_store(monkeypatch, uri: str, tmp_path) -> tuple[MlflowClient, str]:
    """Points the caller at `uri`, in an experiment of the test's own (through MLFLOW_EXPERIMENT_NAME)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    name = f"fanrun-test-{uuid.uuid4().hex[:8]}"
    # A local store's artifacts go to the test's folder; a server keeps them in its own.
    location = (tmp_path / "artifacts").as_uri() if uri.startswith("sqlite") else None
    experiment_id = client.create_experiment(name, artifact_location=location)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    return client, experiment_id


@pytest.fixture
def sqlite_store(monkeypatch, sqlite_uri, tmp_path):
    return use_store(monkeypatch, sqlite_uri, tmp_path)


@pytest.fixture
def server_store(monkeypatch, server, tmp_path):
    return use_store(monkeypatch, server.url, tmp_path)


def only_run(client: MlflowClient, experiment_id: str):
    runs = client.search_runs([experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def by_rank(client: MlflowClient, run_id: str, key: str, world_size: int = 2) -> list[list[tuple[int, float]]]:
    """Each rank's history of `key`: rank 0's under the key, rank N's under key/rank_N."""
    return [history(client, run_id, key if rank == 0 else f"{key}/rank_{rank}") for rank in range(world_size)]


def artifact_text(client: MlflowClient, run_id: str, path: str, tmp_path) -> str:
    local = client.download_artifacts(run_id, path, str(tmp_path / f"download-{uuid.uuid4().hex[:6]}"))
    with open(local, errors="replace") as file:
        return file.read()


# ---------------------------------------------------------------- what the ranks run


@distributed(num_accelerators=2)
def train(steps: int):
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    active = mlflow.active_run()
    for step in range(steps):
        mlflow.log_metric("loss", 10.0 * rank + step, step=step)
    print(f"rank {rank} trained", flush=True)
    return active.info.run_id if active is not None else None


@distributed(num_accelerators=2, tracking=False)
def untracked():
    import os

    return os.environ.get("FANRUN_MLFLOW"), os.environ.get("MLFLOW_RUN_ID")


# ---------------------------------------------------------------- one run, every rank


def check_trained_run(client, experiment_id, run_ids, tmp_path):
    fanrun.flush_tracking()  # the run is closed moments after the call returns
    run = only_run(client, experiment_id)
    run_id = run.info.run_id
    # Every rank's active run is the call's run, and both ranks' metrics are on it.
    assert run_ids == [run_id, run_id]
    assert by_rank(client, run_id, "loss") == [[(s, float(s)) for s in range(3)], [(s, 10.0 + s) for s in range(3)]]
    assert run.info.status == "FINISHED"
    assert run.info.run_name.startswith("train-")
    assert run.data.params == {
        "fanrun.function": "train",
        "fanrun.world_size": "2",
        "fanrun.num_accelerators": "2",
        "fanrun.accelerator_type": "CPU",
        "fanrun.accelerators": "2 CPU processes",
        "fanrun.timeout_s": "10800",
        "fanrun.version": fanrun.__version__,
    }
    assert sorted(a.path for a in client.list_artifacts(run_id, "logs")) == ["logs/rank_0.txt", "logs/rank_1.txt"]
    assert "rank 1 trained" in artifact_text(client, run_id, "logs/rank_1.txt", tmp_path)
    # Sampled at the start and at the end, at least: CPU needs two readings, so the end has it.
    assert HOST_METRICS <= set(run.data.metrics)
    memory = client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
    assert len(memory) >= 2 and all(m.value > 0 for m in memory)
    assert 0 <= run.data.metrics["system/cpu_utilization_percentage"] <= 100
    return run


def test_every_rank_logs_to_the_call_run_in_a_sqlite_store(sqlite_store, sqlite_uri, capsys, tmp_path):
    client, experiment_id = sqlite_store
    run_ids = train.distributed(3)
    run = check_trained_run(client, experiment_id, run_ids, tmp_path)
    out = capsys.readouterr().out
    experiment = client.get_experiment(experiment_id).name
    assert (
        f"fanrun: MLflow run {run.info.run_name} ({run.info.run_id}) in experiment {experiment}: "
        f"run `fanrun ui --backend-store-uri {sqlite_uri}` to open it\n"
    ) in out


def test_every_rank_logs_to_the_call_run_on_a_server(server_store, server, capsys, tmp_path):
    client, experiment_id = server_store
    run_ids = train.distributed(3)
    run = check_trained_run(client, experiment_id, run_ids, tmp_path)
    out = capsys.readouterr().out
    experiment = client.get_experiment(experiment_id).name
    url = f"{server.url}/#/experiments/{experiment_id}/runs/{run.info.run_id}"
    assert f"fanrun: MLflow run {run.info.run_name} ({run.info.run_id}) in experiment {experiment}: {url}\n" in out
    # The ranks do not print MLflow's own "View run" lines at exit: the caller's line is enough.
    assert not [line for line in out.splitlines() if line.startswith("[rank") and "View run" in line]


# ---------------------------------------------------------------- the store when the call ends

STEPS_AT_THE_END = 200


@pytest.fixture(params=["sqlite", "file store", "server"])
def any_store(request, monkeypatch, tmp_path):
    """Each kind of store a run can go to: a sqlite file, MLflow's folder of runs, a server."""
    if request.param == "sqlite":
        return use_store(monkeypatch, request.getfixturevalue("sqlite_uri"), tmp_path)
    if request.param == "server":
        return use_store(monkeypatch, request.getfixturevalue("server").url, tmp_path)
    # MLflow 3 refuses its folder store unless told it is wanted, in this process and the agent.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return use_store(monkeypatch, (tmp_path / "mlruns").as_uri(), tmp_path)


@distributed(num_accelerators=2)
def logs_to_the_end(folder: str, fail: bool) -> int:
    """Logs a param and STEPS_AT_THE_END values, the last ones right before the end; with `fail`,
    rank 1 then raises, once both ranks have logged everything (each value goes out at once:
    MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS=0), and rank 0 is stopped."""
    import os
    import time
    from pathlib import Path

    import mlflow

    rank = int(os.environ["RANK"])
    mlflow.log_param(f"param_of_rank_{rank}", "set")
    for step in range(STEPS_AT_THE_END):
        mlflow.log_metric(f"rank_{rank}_steps", float(step), step=step)
    if not fail:
        return rank
    Path(folder, f"logged-{rank}").touch()
    while not all(Path(folder, f"logged-{r}").exists() for r in range(2)):
        time.sleep(0.02)
    if rank == 1:
        raise ValueError("rank 1 fails after logging")
    time.sleep(60)
    return rank


def logged_values(client: MlflowClient, run) -> dict[int, list[float]]:
    """Each rank's values, whatever key the run holds them under (rank_<N>_steps is in each)."""
    values: dict[int, list[float]] = {}
    for key in run.data.metrics:
        for rank in range(2):
            if f"rank_{rank}_steps" in key:
                values[rank] = sorted(m.value for m in client.get_metric_history(run.info.run_id, key))
    return values


@pytest.mark.parametrize("fail", [False, True], ids=["succeeds", "fails"])
def test_when_a_call_returns_or_raises_its_run_is_complete_in_the_store(any_store, fail, monkeypatch, tmp_path):
    """Read at once, with no flush and no wait: the run's final status (with the error's tag),
    the call's and the ranks' params, every value the ranks logged, and the ranks' logs."""
    client, experiment_id = any_store
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "0")
    if fail:
        with pytest.raises(ValueError, match="rank 1 fails after logging"):
            logs_to_the_end.distributed(str(tmp_path), True)
    else:
        assert logs_to_the_end.distributed(str(tmp_path), False) == [0, 1]
    run = only_run(client, experiment_id)
    assert run.info.status == ("FAILED" if fail else "FINISHED")
    if fail:
        assert run.data.tags["fanrun.error"].startswith("ValueError: [rank 1] rank 1 fails after logging")
    assert run.data.params["fanrun.world_size"] == "2"
    # Rank 1's param is under its key/rank_1 (docs/tracking.md): it reaches the store through the agent.
    assert run.data.params["param_of_rank_0"] == run.data.params["param_of_rank_1/rank_1"] == "set"
    every_step = [float(step) for step in range(STEPS_AT_THE_END)]
    assert logged_values(client, run) == {0: every_step, 1: every_step}
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "logs")) == ["logs/rank_0.txt", "logs/rank_1.txt"]


@distributed(num_accelerators=2)
def outlives_rank_1(rank_1_alive: str) -> tuple[str, int | None, str]:
    """Rank 1 holds the FIFO `rank_1_alive` open and returns with only the call's run active, which
    MLflow's exit handler would end; rank 0 reads the FIFO to its end, which comes when rank 1's
    process is gone (after every exit handler of its), then reads the call's run from the store,
    and returns with a nested run of its own left open."""
    import os

    import mlflow

    if os.environ["RANK"] == "1":
        os.open(rank_1_alive, os.O_WRONLY)  # closed by rank 1's exit, and by nothing before it
        return "", None, ""
    with open(rank_1_alive, "rb") as fifo:
        fifo.read()
    run = mlflow.MlflowClient().get_run(mlflow.active_run().info.run_id)
    own = mlflow.start_run(nested=True, run_name="left-open-by-rank-0")
    return run.info.status, run.info.end_time, own.info.run_id


def test_a_rank_that_exits_leaves_the_calls_run_open_and_ends_its_own(sqlite_store, tmp_path):
    """The call's run belongs to the agent, which closes it with the call's outcome: a rank's exit
    never ends it (nor rewrites it while the agent writes to it, which a file store does not survive).
    A run the function started in a rank and left open is ended at the rank's exit, as MLflow does."""
    client, experiment_id = sqlite_store
    rank_1_alive = tmp_path / "rank-1-alive"
    os.mkfifo(rank_1_alive)
    (status, end_time, own_run_id), _ = outlives_rank_1.distributed(str(rank_1_alive))
    assert (status, end_time) == ("RUNNING", None)
    own = client.get_run(own_run_id)
    assert own.info.status == "FINISHED" and own.info.end_time is not None
    call_run = client.get_run(own.data.tags["mlflow.parentRunId"])
    assert call_run.info.run_name.startswith("outlives_rank_1-")
    assert call_run.info.status == "FINISHED"


@distributed(num_accelerators=2)
def log_every_way():
    """Each way a function logs metrics: they travel through the caller, and must all arrive."""
    import os

    import mlflow

    import numpy

    rank = int(os.environ["RANK"])
    run_id = mlflow.active_run().info.run_id
    # Each rank's values differ: MLflow's store keeps one row for equal (key, value, step,
    # timestamp), and two ranks can log in the same millisecond.
    mlflow.log_metrics({"accuracy": 0.5 + rank, "lr": 0.1 * (rank + 1)}, step=1)
    mlflow.log_metric("numpy_value", numpy.float32(2.5 + rank), step=1)
    mlflow.log_metric("timed", 1.0 + rank, step=5, timestamp=1_700_000_000_123, synchronous=False).wait()
    mlflow.MlflowClient().log_metric(run_id, "client_metric", 3.0 + rank, step=2)
    # A DataLoader worker forked from the rank ends with os._exit: its values go at once.
    child = os.fork()
    if child == 0:
        try:
            mlflow.log_metric("from_forked_worker", 7.0 + rank, step=3)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    # A run of the function's own goes straight to the store, and its values land there.
    with mlflow.start_run(nested=True, run_name=f"inner-{rank}") as inner:
        mlflow.log_metric("inner_metric", 5.0 + rank, step=4)
    try:
        mlflow.log_metric("bad name!*", 1.0)
        bad_name_error = None
    except mlflow.exceptions.MlflowException as error:
        bad_name_error = str(error)
    return inner.info.run_id, bad_name_error


def test_every_way_of_logging_reaches_its_run(sqlite_store):
    client, experiment_id = sqlite_store
    results = log_every_way.distributed()
    fanrun.flush_tracking()
    outer = [r for r in client.search_runs([experiment_id]) if r.info.run_name.startswith("log_every_way-")]
    assert len(outer) == 1, [(r.info.run_name, r.info.lifecycle_stage) for r in client.search_runs([experiment_id])]
    run_id = outer[0].info.run_id
    assert by_rank(client, run_id, "accuracy") == [[(1, 0.5)], [(1, 1.5)]]
    assert by_rank(client, run_id, "lr") == [[(1, 0.1)], [(1, 0.2)]]
    assert by_rank(client, run_id, "numpy_value") == [[(1, 2.5)], [(1, 3.5)]]
    for key, rank in (("timed", 0), ("timed/rank_1", 1)):
        timed = [(m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key)]
        assert timed == [(5, 1_700_000_000_123, 1.0 + rank)]
    assert by_rank(client, run_id, "client_metric") == [[(2, 3.0)], [(2, 4.0)]]
    assert by_rank(client, run_id, "from_forked_worker") == [[(3, 7.0)], [(3, 8.0)]]
    assert "inner_metric" not in client.get_run(run_id).data.metrics
    for rank, (inner_id, bad_name_error) in enumerate(results):
        assert history(client, inner_id, "inner_metric") == [(4, 5.0 + rank)]
        assert client.get_run(inner_id).data.tags["mlflow.parentRunId"] == run_id
        # A bad name fails in the rank's own call, as it would without fanrun.
        assert bad_name_error is not None and "bad name!*" in bad_name_error


@distributed(num_accelerators=2)
def logs_as_every_rank_does(steps: int) -> str | None:
    """What a training loop run on every rank logs: the same metric names, the same
    hyperparameters, and a param and a tag whose values are the rank's own."""
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    mlflow.log_params({"lr": "0.1", "seed": str(1000 + rank)})
    mlflow.set_tag("host_role", "leader" if rank == 0 else "worker")
    mlflow.set_tag("team", "vision")
    for step in range(steps):
        mlflow.log_metric("loss", 100.0 * rank + step, step=step)
    mlflow.log_metric(f"named/rank_{rank}", float(rank))  # named by its rank already: kept as it is
    try:  # a rank that changes its own param: MLflow's error, in its own call
        mlflow.log_param("lr", "0.2")
    except mlflow.exceptions.MlflowException as error:
        return str(error)
    return None


def test_each_key_holds_rank_0s_values_and_key_rank_n_rank_ns(sqlite_store):
    """Two ranks logging under the same names: `loss` is one series, one value per step, rank
    0's; `loss/rank_1` is rank 1's. A param logged alike by both is one param; one whose value
    differs is rank 0's under its key and rank 1's under key/rank_1, with a one-line warning
    naming both, and the call succeeds. Tags follow the same rule."""
    client, experiment_id = sqlite_store
    with pytest.warns(TrackingWarning) as caught:
        changed = logs_as_every_rank_does.distributed(5)
    assert all("Changing param values is not allowed" in message for message in changed), changed
    run = only_run(client, experiment_id)
    assert run.info.status == "FINISHED"
    run_id = run.info.run_id
    assert history(client, run_id, "loss") == [(step, float(step)) for step in range(5)]
    assert history(client, run_id, "loss/rank_1") == [(step, 100.0 + step) for step in range(5)]
    assert {key for key in run.data.metrics if key.startswith("named")} == {"named/rank_0", "named/rank_1"}
    params = {k: v for k, v in run.data.params.items() if not k.startswith("fanrun.")}
    assert params == {"lr": "0.1", "seed": "1000", "seed/rank_1": "1001"}
    tags = {k: v for k, v in run.data.tags.items() if not k.startswith(("mlflow.", "fanrun."))}
    assert tags == {"host_role": "leader", "host_role/rank_1": "worker", "team": "vision"}
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "\n" not in messages[0]
    assert "parameter 'seed' differs by rank (rank 0: '1000', rank 1: '1001')" in messages[0]


# ---------------------------------------------------------------- where runs go without configuration


def caller_env(tmp_path, **extra: str) -> dict[str, str]:
    """A user's environment: MLflow not configured, tracking on, fanrun's data under tmp_path/data."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k not in ("FANRUN_TRACKING", "XDG_DATA_HOME")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    env.update(extra)
    return env


def run_caller(code: str, tmp_path, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """A script that calls .distributed(), run as a user runs one, from tmp_path/work."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, cwd=work,
                          env=env if env is not None else caller_env(tmp_path), timeout=timeout)


CALLER_LOGS_ONE = """
from fanrun import distributed

@distributed(num_accelerators=2)
def log_one():
    import mlflow
    mlflow.log_metric("one", 1.0)
    return mlflow.active_run().info.run_id

run_ids = log_one.distributed()
import mlflow  # the caller's own mlflow calls, after the call, find the same runs
print("runs", run_ids[0], [r.info.run_id for r in mlflow.MlflowClient().search_runs(["0"])], flush=True)
"""


@pytest.mark.parametrize("where", ["XDG_DATA_HOME", "HOME"])
def test_without_configuration_runs_go_to_fanruns_private_store(tmp_path, where):
    """With no tracking URI set, runs go to $XDG_DATA_HOME/fanrun/mlflow (else ~/.local/share/...):
    a sqlite store with its artifacts beside it, in folders only the user can open; nothing is
    written to the working directory, and the caller's own mlflow calls find the same runs."""
    env = caller_env(tmp_path)
    if where == "HOME":
        del env["XDG_DATA_HOME"]
        env["HOME"] = str(tmp_path / "home")
        data = tmp_path / "home" / ".local" / "share"
    else:
        data = tmp_path / "data"
    done = run_caller(CALLER_LOGS_ONE, tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    store = data / "fanrun" / "mlflow"
    for folder in (store.parent, store):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert list((tmp_path / "work").iterdir()) == []  # no ./mlflow.db, no ./mlruns
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    (run,) = client.search_runs(["0"])
    assert f"runs {run.info.run_id} ['{run.info.run_id}']" in done.stdout
    assert run.info.status == "FINISHED" and run.data.metrics["one"] == 1.0
    logs = store / "artifacts" / "0" / run.info.run_id / "artifacts" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank_0.txt", "rank_1.txt"]
    assert f"fanrun: MLflow run {run.info.run_name} ({run.info.run_id}) in experiment Default: run `fanrun ui` to open it\n" in done.stdout

    # Where the caller already uses MLflow's own default store (a run of it is active), MLflow's
    # rules stand: the call's run goes there too, nested under it.
    inside = run_caller(CALLER_INSIDE_ITS_OWN_RUN, tmp_path, env=env)
    assert inside.returncode == 0, inside.stderr
    parent_id, child_id = inside.stdout.split("ids ")[1].split()[:2]
    own_default = MlflowClient(f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    assert own_default.get_run(child_id).data.tags["mlflow.parentRunId"] == parent_id
    assert len(client.search_runs(["0"])) == 1


CALLER_INSIDE_ITS_OWN_RUN = """
import mlflow
from fanrun import distributed

@distributed(num_accelerators=2)
def child():
    import mlflow
    return mlflow.active_run().info.run_id

with mlflow.start_run() as parent:  # in MLflow's own default store, ./mlflow.db
    print("ids", parent.info.run_id, child.distributed()[0], flush=True)
"""


CALLER_PLAIN = """
from fanrun import distributed

@distributed(num_accelerators=2)
def rank():
    import os
    return int(os.environ["RANK"])

print("results", rank.distributed(), flush=True)
"""


@pytest.mark.parametrize("whose", ["another user's", "writable by others"])
def test_a_default_store_folder_that_is_not_the_users_alone_is_not_used(tmp_path, whose):
    """fanrun keeps runs only in a folder that is the user's and nobody else can write: one that
    another user planted, or that others can write, turns tracking off for the call with a
    warning that says why; the call still runs, and nothing is written there or in the cwd."""
    store = tmp_path / "data" / "fanrun" / "mlflow"
    store.mkdir(parents=True)
    os.chmod(store.parent, 0o700)
    if whose == "another user's":
        os.chown(store, 65534, 65534)
        os.chmod(store, 0o700)
    else:
        os.chmod(store, 0o777)
    done = run_caller(CALLER_PLAIN, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "results [0, 1]" in done.stdout
    assert "TrackingWarning: fanrun: MLflow tracking is off for this call of 'rank'" in done.stderr
    assert ("belongs to uid 65534" if whose == "another user's" else "(mode 0777)") in done.stderr
    assert list(store.iterdir()) == [] and list((tmp_path / "work").iterdir()) == []


def test_a_tracked_call_shows_none_of_mlflows_own_noise(tmp_path):
    """MLflow's INFO lines ("Creating initial MLflow database tables...") and tqdm's warnings come
    from what fanrun makes MLflow do, not from the user's code: none reaches the user."""
    done = run_caller(CALLER_LOGS_ONE, tmp_path)  # a new store: MLflow creates its tables
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    for noise in ("INFO mlflow", "Tqdm", "IProgress", "Creating initial"):
        assert noise not in output, output


def test_experiment_name_argument_chooses_the_experiment(sqlite_store, sqlite_uri):
    client, other_experiment = sqlite_store
    name = f"fanrun-named-{uuid.uuid4().hex[:8]}"

    @distributed(num_accelerators=2, experiment_name=name)
    def named():
        return 1

    assert named.distributed() == [1, 1]
    fanrun.flush_tracking()
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    assert [r.info.status for r in client.search_runs([experiment.experiment_id])] == ["FINISHED"]
    assert client.search_runs([other_experiment]) == []


TRACKED_SCRIPT = """
import os, mlflow
rank = int(os.environ["RANK"])
active = mlflow.active_run()
print("active", active.info.run_id if active is not None else None, os.environ.get("MLFLOW_TRACKING_URI"), flush=True)
if active is not None:
    for step in range(3):
        mlflow.log_metric("loss", 10.0 * rank + step, step=step)
    if rank == 0:
        mlflow.log_param("lr", "0.1")
"""


def fanrun_run(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fanrun", "run", "-n", "2", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_fanrun_run_leaves_mlflow_alone_unless_a_flag_makes_a_run_that_every_rank_logs_to(sqlite_store, sqlite_uri,
                                                                                           tmp_path):
    client, experiment_id = sqlite_store
    (tmp_path / "tracked.py").write_text(TRACKED_SCRIPT)
    # As under torchrun: no run, and the ranks' MLflow is configured as the caller's environment says.
    done = fanrun_run("tracked.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"[rank{rank}]: active None {sqlite_uri}" for rank in (0, 1)]
    assert client.search_runs([experiment_id]) == []

    name = f"fanrun-cli-{uuid.uuid4().hex[:8]}"
    done = fanrun_run("--experiment-name", name, "--run-name", "first-try", "tracked.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    experiment = client.get_experiment_by_name(name)
    run = only_run(client, experiment.experiment_id)
    run_id = run.info.run_id
    assert f"fanrun: MLflow run first-try ({run_id}) in experiment {name}" in done.stdout, done.stdout
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("[rank")) == [
        f"[rank{rank}]: active {run_id} {sqlite_uri}" for rank in (0, 1)]
    assert run.info.status == "FINISHED" and run.info.run_name == "first-try"
    assert by_rank(client, run_id, "loss") == [[(s, float(s)) for s in range(3)], [(s, 10.0 + s) for s in range(3)]]
    assert run.data.params["lr"] == "0.1" and run.data.params["fanrun.function"] == "tracked.py"
    assert f"active {run_id}" in artifact_text(client, run_id, "logs/rank_1.txt", tmp_path)
    assert client.search_runs([experiment_id]) == []

    # Detached, in the caller's experiment: the run's own process makes the run.
    done = fanrun_run("--tracking", "--detach", "--watch", "tracked.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run = only_run(client, experiment_id)
    assert run.info.status == "FINISHED" and run.info.run_name.startswith("tracked.py-")
    assert by_rank(client, run.info.run_id, "loss")[1] == [(s, 10.0 + s) for s in range(3)]
    from fanrun._launch.records import RunRecord

    runner = RunRecord.find(done.stdout.splitlines()[0]).read_runner()["pid"]
    assert wait_gone([runner], timeout=10) == []


CALLER_TIMED = """
import sys, time
from fanrun import distributed

@distributed(num_accelerators=2, tracking=sys.argv[1] == "on")
def works(seconds):
    import time
    time.sleep(seconds)  # what a GPU rank mostly does: wait on its device, not on the CPU
    return 1

started = time.perf_counter()
works.distributed(float(sys.argv[2]))
print("call", time.perf_counter() - started, flush=True)
"""
# Generous for a machine shared with other work; the goal is 5 % or 0.2 s.
COST_BOUND_S = 1.0
# How long the first call's ranks work: the agent's start and MLflow's import (about two seconds
# of CPU) happen meanwhile; a call whose ranks end sooner waits for the rest of them.
FIRST_CALL_RANK_S = "5"


@pytest.mark.slow
def test_a_tracked_call_costs_what_an_untracked_one_does(tmp_path):
    """Importing MLflow and making the run happen beside the ranks: a process's first call, from a
    fresh script (MLflow not yet imported) to the ranks' results, whose ranks work for
    FIRST_CALL_RANK_S (longer than MLflow's import), is within COST_BOUND_S of the same call
    untracked, its wait for the run's close included. Interleaved, medians of 3."""

    def call_seconds(mode: str) -> float:
        done = run_caller(CALLER_TIMED, tmp_path, mode, FIRST_CALL_RANK_S)
        assert done.returncode == 0, done.stderr
        return float(done.stdout.split("call ")[1].split()[0])

    call_seconds("on")  # the store's creation, once: not what each call costs
    times = {"on": [], "off": []}
    for _ in range(3):
        for mode in times:
            times[mode].append(call_seconds(mode))
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    assert on <= off * 1.05 + COST_BOUND_S, times


# ---------------------------------------------------------------- fanrun ui: the run one click away

RUN_LINE = re.compile(r"fanrun: MLflow run (\S+) \((\w+)\) in experiment (.+?): (.+)")


class Ui:
    """`fanrun ui` as a user starts it in a terminal: its own process group, which Ctrl+C signals."""

    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.marker = f"FANRUN_UI_TEST={uuid.uuid4().hex}"
        env = caller_env(tmp_path, FANRUN_UI_TEST=self.marker.split("=")[1])
        fanrun_command = Path(sys.executable).with_name("fanrun")
        self.process = subprocess.Popen([str(fanrun_command), "ui", "--port", str(self.port)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.first_line = self.process.stdout.readline()  # its address once it answers (or "" if it failed)
        self.url = f"http://127.0.0.1:{self.port}"

    def interrupt(self) -> int:
        os.killpg(self.process.pid, signal.SIGINT)  # Ctrl+C: the terminal signals the foreground group
        code = self.process.wait(60)
        self.stderr = self.process.stderr.read()
        return code

    def left(self) -> list:
        return processes_with_environment(self.marker.encode())

    def kill(self) -> None:
        for pid, _ in self.left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(60)
        wait_gone([pid for pid, _ in self.left()], 30)
        self.process.stdout.close()
        self.process.stderr.close()


@pytest.fixture
def ui(tmp_path):
    started = Ui(tmp_path)
    yield started
    started.kill()


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


@pytest.mark.slow
def test_fanrun_ui_serves_the_store_on_loopback_and_each_call_links_to_its_run(tmp_path, ui):
    """`fanrun ui` serves MLflow's UI for fanrun's store on 127.0.0.1 until Ctrl+C; while it is
    up, a call's line links to its run there; Ctrl+C stops it and every process it started, and
    calls say again how to open their run."""
    store_uri = f"sqlite:///{tmp_path / 'data' / 'fanrun' / 'mlflow' / 'mlflow.db'}"
    assert ui.first_line.startswith(f"fanrun: MLflow UI for {store_uri} at {ui.url} (Ctrl+C stops it"), (
        ui.first_line + ui.process.stderr.read() if ui.process.poll() is not None else ui.first_line)
    with urllib.request.urlopen(ui.url + "/health", timeout=10) as answer:
        assert answer.status == 200
    assert listening_addresses(ui.port) == {"0100007F"}  # 127.0.0.1, and nothing else

    done = run_caller(CALLER_PLAIN, tmp_path)
    assert done.returncode == 0, done.stderr
    name, run_id, experiment, where = RUN_LINE.search(done.stdout).groups()
    assert where == f"{ui.url}/#/experiments/0/runs/{run_id}"
    with urllib.request.urlopen(f"{ui.url}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30) as answer:
        assert json.load(answer)["run"]["info"]["status"] == "FINISHED"

    assert ui.interrupt() == 0
    assert "MLflow UI stopped" in ui.stderr
    assert wait_gone([pid for pid, _ in ui.left()], 30) == []
    assert ui.left() == []
    after = run_caller(CALLER_PLAIN, tmp_path)
    assert RUN_LINE.search(after.stdout).group(4) == "run `fanrun ui` to open it"


NOTEBOOK_LOGGING_CELL = """
from fanrun import distributed

@distributed(num_accelerators=2)
def logs():
    import mlflow
    mlflow.log_metric("loss", 0.5)
    return mlflow.active_run().info.run_id

print("returned", logs.distributed())
"""


@pytest.mark.slow
def test_in_jupyter_a_tracked_cell_shows_a_link_to_fanrun_ui_and_no_mlflow_noise(tmp_path, ui, monkeypatch):
    """The first tracked cell of a kernel (MLflow not yet imported, a new store) shows the run as a
    link to the running `fanrun ui`, and neither MLflow's INFO lines nor tqdm's IProgress warning."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    assert ui.first_line.startswith("fanrun: MLflow UI for"), ui.first_line
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_LOGGING_CELL)])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    html = [o.data["text/html"] for o in outputs if o.output_type == "display_data" and "text/html" in o.data]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    run_id = re.search(r"returned \['(\w+)', '\1'\]", text).group(1)
    assert len(html) == 1 and f'href="{ui.url}/#/experiments/0/runs/{run_id}"' in html[0]
    for noise in ("INFO mlflow", "Tqdm", "IProgress", "Creating initial"):
        assert noise not in text, text


# ---------------------------------------------------------------- nesting and resuming


def test_a_call_inside_an_active_run_is_its_child(sqlite_store):
    client, experiment_id = sqlite_store
    with mlflow.start_run(run_name="parent") as parent:
        run_ids = train.distributed(2)
        assert mlflow.active_run().info.run_id == parent.info.run_id  # the caller's run is untouched
    fanrun.flush_tracking()
    child = client.get_run(run_ids[0])
    assert child.info.run_id != parent.info.run_id
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id == experiment_id
    assert child.info.status == "FINISHED"
    assert [len(h) for h in by_rank(client, child.info.run_id, "loss")] == [2, 2]
    assert client.get_metric_history(parent.info.run_id, "loss") == []


@distributed(num_accelerators=2, max_restarts=2)
def fails_twice_then_trains():
    import os

    import mlflow

    attempt = int(os.environ["FANRUN_RESTART_COUNT"])
    mlflow.log_metric("attempt", attempt, step=int(os.environ["RANK"]))
    if attempt < 2 and os.environ["RANK"] == "1":
        raise RuntimeError(f"attempt {attempt} lost")
    return mlflow.active_run().info.run_id


def test_a_call_that_restarts_is_one_run_with_each_attempt_nested_under_it(sqlite_store, capfd):
    client, experiment_id = sqlite_store
    last_attempt = fails_twice_then_trains.distributed()[0]
    fanrun.flush_tracking()
    runs = {run.info.run_name: run for run in client.search_runs([experiment_id])}
    name = min(runs, key=len)  # fails_twice_then_trains-<6 hex digits>
    assert sorted(runs) == [name] + [f"{name}-attempt-{number}" for number in (1, 2, 3)]
    parent = runs[name]
    assert parent.info.status == "FINISHED" and parent.data.tags["fanrun.attempts"] == "3"
    assert parent.data.params["fanrun.max_restarts"] == "2" and parent.data.params["fanrun.restart"] == "keep"
    assert client.get_metric_history(parent.info.run_id, "attempt") == []  # the ranks log on their attempt's run
    for number in (1, 2, 3):
        attempt = runs[f"{name}-attempt-{number}"]
        assert attempt.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert attempt.data.params["fanrun.attempt"] == str(number)
        assert attempt.info.status == ("FINISHED" if number == 3 else "FAILED")
        logged = by_rank(client, attempt.info.run_id, "attempt")
        # A failing rank's metrics reach its run before the call stops: rank 1's on every attempt.
        assert (1, number - 1) in logged[1] and (number < 3 or logged == [[(0, 2)], [(1, 2)]]), logged
    assert runs[f"{name}-attempt-1"].data.tags["fanrun.error"].startswith("RuntimeError: [rank 1] attempt 0 lost")
    assert last_attempt == runs[f"{name}-attempt-3"].info.run_id
    out, _ = capfd.readouterr()
    assert out.count("fanrun: MLflow run ") == 1 and f"fanrun: MLflow run {name} (" in out  # the submission's alone


@distributed(num_accelerators=2, keep_alive=True)
def logs_in_a_kept_rank(call: int):
    import os
    import sys

    import mlflow

    mlflow.log_metric("call", call, step=call)
    mlflow.log_param("first_call", call)  # a new run each call: never a changed param
    # The call's run needs no store in the rank: a sqlite one would import SQLAlchemy.
    store_opened = "sqlalchemy" in sys.modules
    run_id = mlflow.active_run().info.run_id
    if call == 0:
        mlflow.start_run(run_name="left-active", nested=True)  # ended as the process's exit would end it
        mlflow.set_experiment("the-function's-own")  # forgotten after the call, as by a new process
    return os.getpid(), run_id, store_opened


def test_a_kept_rank_whose_function_imports_mlflow_stays_and_logs_each_call_on_its_own_run(sqlite_store, capfd):
    client, experiment_id = sqlite_store
    calls = [logs_in_a_kept_rank.distributed(call) for call in range(3)]
    fanrun.flush_tracking()
    try:
        assert "instead of staying" not in capfd.readouterr().err
        assert [pid for pid, _, _ in calls[0]] == [pid for pid, _, _ in calls[2]]  # the same processes throughout
        assert not any(store_opened for _, _, store_opened in calls[0])
        nested = [run for run in client.search_runs([experiment_id]) if run.info.run_name == "left-active"]
        assert [run.info.status for run in nested] == ["FINISHED"] * 2  # one a rank
        for call, result in enumerate(calls):
            run_ids = {run_id for _, run_id, _ in result}
            assert len(run_ids) == 1, result
            run = client.get_run(run_ids.pop())
            assert run.info.status == "FINISHED" and run.data.params["first_call"] == str(call)
            assert by_rank(client, run.info.run_id, "call") == [[(call, call)], [(call, call)]]
            assert "first_call/rank_1" not in run.data.params  # rank 1's value is rank 0's
    finally:
        fanrun.cooldown()


@distributed(num_accelerators=2, warm=True)
def logs_in_a_warm_rank(call: int):
    import sys

    preloaded = "mlflow" in sys.modules  # imported by the spare this rank was
    import mlflow

    mlflow.log_metric("call", call, step=call)
    return preloaded, mlflow.active_run().info.run_id


def test_a_warm_calls_spares_import_mlflow_ahead_and_log_on_the_next_calls_run(sqlite_store):
    client, experiment_id = sqlite_store
    try:
        first = logs_in_a_warm_rank.distributed(0)  # cold; tracked, so the spares it starts import mlflow
        assert POOL.wait_ready(120)
        second = logs_in_a_warm_rank.distributed(1)
    finally:
        fanrun.cooldown()
    fanrun.flush_tracking()
    assert [preloaded for preloaded, _ in first] == [False, False]
    assert [preloaded for preloaded, _ in second] == [True, True]
    for call, result in enumerate((first, second)):
        (run_id,) = {run_id for _, run_id in result}
        assert client.get_run(run_id).info.status == "FINISHED"
        assert by_rank(client, run_id, "call") == [[(call, call)], [(call, call)]]
    assert first[0][1] != second[0][1]


def test_run_id_resumes_that_run_and_start_run_with_it_nests_under_it(sqlite_store):
    client, experiment_id = sqlite_store
    earlier = client.create_run(experiment_id, run_name="earlier")
    client.log_metric(earlier.info.run_id, "loss", 99.0, step=0)
    client.set_terminated(earlier.info.run_id, "FAILED")

    resumed = distributed(num_accelerators=2, run_id=earlier.info.run_id)(train.__wrapped__)
    assert resumed.distributed(2) == [earlier.info.run_id] * 2
    fanrun.flush_tracking()
    again = client.get_run(earlier.info.run_id)
    assert again.info.status == "FINISHED"
    assert (0, 99.0) in history(client, earlier.info.run_id, "loss")
    assert [len(h) for h in by_rank(client, earlier.info.run_id, "loss")] == [3, 2]  # 99.0 from before
    assert len(client.search_runs([experiment_id])) == 1  # resumed, not a new run

    with mlflow.start_run(run_id=earlier.info.run_id):
        child_ids = train.distributed(1)
    fanrun.flush_tracking()
    child = client.get_run(child_ids[0])
    assert child.data.tags["mlflow.parentRunId"] == earlier.info.run_id


def test_run_id_that_names_no_run_is_an_error_before_anything_starts(sqlite_store, runs_dir):
    before = set(runs_dir.iterdir())

    @distributed(num_accelerators=2, run_id="0123456789abcdef0123456789abcdef")
    def never():
        return 1

    with pytest.raises(fanrun.RunNotFoundError, match=r"run_id='0123456789abcdef0123456789abcdef' names no MLflow run in sqlite:"):
        never.distributed()
    assert set(runs_dir.iterdir()) == before  # no rank was started


# ---------------------------------------------------------------- how the run ends


def test_a_failed_rank_fails_the_run_with_the_root_cause_as_a_tag(sqlite_store, tmp_path):
    client, experiment_id = sqlite_store

    @distributed(num_accelerators=2)
    def breaks():
        import os

        if os.environ["RANK"] == "1":
            raise ValueError("the data on rank one is bad")
        import time

        time.sleep(60)

    with pytest.raises(ValueError, match="the data on rank one is bad"):
        breaks.distributed()
    fanrun.flush_tracking()
    run = only_run(client, experiment_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["fanrun.error"].startswith("ValueError: [rank 1] the data on rank one is bad")
    # The logs are uploaded whatever the outcome: the traceback is in rank 1's.
    assert "the data on rank one is bad" in artifact_text(client, run.info.run_id, "logs/rank_1.txt", tmp_path)


def test_a_timeout_kills_the_run(sqlite_store):
    client, experiment_id = sqlite_store

    @distributed(num_accelerators=2, timeout=2)
    def sleeps():
        import time

        time.sleep(60)

    with pytest.raises(fanrun.RunTimeoutError):
        sleeps.distributed()
    fanrun.flush_tracking()
    run = only_run(client, experiment_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["fanrun.stop_reason"] == "timeout"


CALLER_INTERRUPTED = textwrap.dedent(
    """
    from fanrun import distributed

    @distributed(num_accelerators=2)
    def waits():
        import time
        print("ready", flush=True)
        time.sleep(300)

    try:
        waits.distributed()
    except KeyboardInterrupt:
        print("caller: interrupted", flush=True)
    """
)


def test_an_interrupt_kills_the_run(sqlite_store, tmp_path):
    client, experiment_id = sqlite_store
    env = {k: v for k, v in os.environ.items() if k != "FANRUN_TRACKING"}
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER_INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env
    )
    ready = 0
    while ready < 2:  # both ranks running: the interrupt lands mid-run
        line = caller.stdout.readline()
        if not line:
            caller.wait(30)
            pytest.fail(f"the caller ended before its ranks were ready: {caller.stderr.read()}")
        ready += line.endswith(": ready\n")
    caller.send_signal(signal.SIGINT)
    out, err = caller.communicate(timeout=60)
    assert "caller: interrupted" in out, err
    run = only_run(client, experiment_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["fanrun.stop_reason"] == "interrupted"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (None, "FINISHED"),
        (KeyboardInterrupt(), "KILLED"),
        (fanrun.RunTimeoutError("late", running_ranks=[0], stacks={}), "KILLED"),
        (fanrun.RankFailedError("gone", rank=3, pid=1, exit_code=1), "FAILED"),
        (ValueError("bad"), "FAILED"),
    ],
)
def test_status_matches_how_the_launcher_ended(error, status):
    got, tags = outcome(error)
    assert got == status
    if status == "FAILED":
        assert tags["fanrun.error"] == f"{type(error).__name__}: {error}"
    if isinstance(error, fanrun.RankFailedError):
        assert tags["fanrun.failed_rank"] == "3"


# ---------------------------------------------------------------- turned off, missing, broken


def test_tracking_false_creates_no_run_and_tells_the_ranks_nothing(sqlite_store, capsys):
    client, experiment_id = sqlite_store
    assert untracked.distributed() == [("off", None), ("off", None)]
    assert client.search_runs([experiment_id]) == []
    assert "MLflow" not in capsys.readouterr().out


CALLER_UNTRACKED_BUT_LOGGING = """
from fanrun import distributed

@distributed(num_accelerators=2, tracking=False)
def logs_anyway():
    import mlflow
    mlflow.log_metric("loss", 1.0)  # MLflow would start a run of its own here, one per rank
    mlflow.log_params({"lr": 0.1})
    mlflow.set_tag("stage", "test")
    mlflow.log_text("notes", "notes.txt")
    with mlflow.start_run(nested=True):
        mlflow.log_metric("inner", 2.0)
    return mlflow.active_run() is not None

print("results", logs_anyway.distributed(), logs_anyway.distributed(), flush=True)
"""


def test_tracking_false_sends_what_the_ranks_log_nowhere_with_one_notice(tmp_path):
    """With tracking off, a function that logs with mlflow runs as it would tracked, but nothing it
    logs makes a run, in the configured store or anywhere: no store is even created. The caller
    says so once per process."""
    store = tmp_path / "store.db"
    done = run_caller(CALLER_UNTRACKED_BUT_LOGGING, tmp_path, env=caller_env(tmp_path, MLFLOW_TRACKING_URI=f"sqlite:///{store}"))
    assert done.returncode == 0, done.stderr
    assert "results [True, True] [True, True]" in done.stdout
    assert not store.exists()
    assert list((tmp_path / "work").iterdir()) == [] and not (tmp_path / "data").exists()
    notices = [line for line in done.stderr.splitlines() if "not tracked" in line]
    assert notices == ["fanrun: this call is not tracked (tracking=False or FANRUN_TRACKING=0), so what its ranks logged "
                       "with mlflow went nowhere; no MLflow run was made. Leave tracking on to keep it."], done.stderr


def test_fanrun_tracking_0_turns_the_default_off(sqlite_store, monkeypatch):
    client, experiment_id = sqlite_store
    monkeypatch.setenv("FANRUN_TRACKING", "0")

    @distributed(num_accelerators=2)
    def tracked_by_default():
        import os

        return os.environ.get("FANRUN_MLFLOW")

    assert tracked_by_default.distributed() == ["off", "off"]
    assert client.search_runs([experiment_id]) == []


def test_unreachable_server_warns_once_and_the_call_still_returns(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.warns(TrackingWarning, match=r"MLflow tracking is off for this call of 'train': the tracking server http://127\.0\.0\.1:\d+ cannot be reached") as caught:
        run_ids = train.distributed(3)
    # No run to make active; the ranks' own log_metric calls went to a private store instead
    # of the dead server, and neither stalled nor failed.
    assert run_ids == [None, None]
    assert len(caught) == 1
    assert time.monotonic() - started < 60


class _Failing(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_error(503, "down for maintenance")

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_server_answering_errors_warns_once_and_the_call_still_returns(monkeypatch):
    failing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=failing.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{failing.server_address[1]}")

        @distributed(num_accelerators=2)
        def plain():
            return 7

        with pytest.warns(TrackingWarning, match=r"answers with errors \(HTTP 503") as caught:
            assert plain.distributed() == [7, 7]
        assert len(caught) == 1
    finally:
        failing.shutdown()
        failing.server_close()


class _SlowToFail(http.server.BaseHTTPRequestHandler):
    """A tracking server that is up (its /health answers) but takes HANG_S to fail each request."""

    HANG_S = 5.0
    answered: list[float] = []

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
            return
        time.sleep(self.HANG_S)
        _SlowToFail.answered.append(time.time())
        self.send_error(503, "overloaded")

    do_POST = do_GET

    def log_message(self, *args):
        pass


@distributed(num_accelerators=2)
def stamps():
    import time

    started = time.time()
    import mlflow

    imported = time.time()
    mlflow.log_metric("dropped", 1.0)  # the call is not tracked: nowhere, without an error
    return started, imported, mlflow.get_tracking_uri()


def test_ranks_start_while_the_run_is_made_and_wait_for_it_only_to_import_mlflow(monkeypatch):
    """The ranks do not wait for the run to be made: they start at once, and only a rank's
    `import mlflow` waits for it, here until the store has failed, which the ranks learn then."""
    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowToFail)
    thread = threading.Thread(target=slow.serve_forever, daemon=True)
    thread.start()
    _SlowToFail.answered.clear()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{slow.server_address[1]}")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        with pytest.warns(TrackingWarning, match=r"MLflow tracking is off for this call of 'stamps'") as caught:
            results = stamps.distributed()
        assert len(caught) == 1
    finally:
        slow.shutdown()
        slow.server_close()
    failed_at = min(_SlowToFail.answered)
    for started, imported, uri in results:
        assert started < failed_at < imported
        assert uri.startswith("fanrun-nowhere:")


CALLER_WITHOUT_MLFLOW = textwrap.dedent(
    """
    import sys
    sys.modules["mlflow"] = None  # what an interpreter without mlflow installed sees: ImportError
    from fanrun import distributed

    @distributed(num_accelerators=2)
    def rank():
        import os
        return int(os.environ["RANK"])

    print("results", rank.distributed(), rank.distributed(), flush=True)
    """
)


def test_without_mlflow_one_notice_and_the_call_still_works(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FANRUN_TRACKING"}
    done = subprocess.run(
        [sys.executable, "-c", CALLER_WITHOUT_MLFLOW], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "results [0, 1] [0, 1]" in done.stdout
    notices = [line for line in done.stderr.splitlines() if "MLflow is not installed" in line]
    assert notices == ["fanrun: MLflow is not installed, so this call is not tracked (pip install mlflow to track it; tracking=False hides this notice)."]
    assert not (tmp_path / "mlflow.db").exists()


def test_import_fanrun_does_not_import_mlflow():
    code = "import sys, fanrun; print(sorted(m for m in sys.modules if m == 'mlflow' or m.startswith('mlflow.')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tracking": "yes"}, TypeError, "tracking must be True or False, not str"),
        ({"tracking": 1}, TypeError, "tracking must be True or False, not int"),
        ({"experiment_name": 3}, TypeError, "experiment_name must be a string or None, not int"),
        ({"experiment_name": "  "}, ValueError, "experiment_name must be a non-empty string"),
        ({"run_id": ""}, ValueError, "run_id must be a non-empty string"),
        ({"run_id": " abc"}, ValueError, "run_id must be a run's id without surrounding spaces"),
        ({"run_id": "abc", "tracking": False}, ValueError, "run_id= needs MLflow tracking, but tracking=False"),
        ({"experiment_name": "x", "tracking": False}, ValueError, "experiment_name= needs MLflow tracking"),
        ({"experiment_name": "x", "run_id": "abc"}, ValueError, "pass one of them, not both"),
    ],
)
def test_bad_tracking_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        distributed(num_accelerators=2, **kwargs)


# ---------------------------------------------------------------- system metrics and the link


def test_sampler_stops_at_once_and_logs_a_first_and_a_last_sample():
    logged: list[tuple[int, dict]] = []
    first = threading.Event()

    def log(metrics, step):
        logged.append((step, metrics))
        first.set()

    sampler = SystemMetricsSampler(log, gpu_indices=[], interval=3600.0, first_step=4)
    sampler.start()
    assert first.wait(10)
    started = time.monotonic()
    assert sampler.stop(join_timeout=10)
    assert time.monotonic() - started < 2  # an Event wait, not an hour's sleep
    sampler.sample()  # the final one, which the run's end logs
    assert [step for step, _ in logged] == [4, 5]
    # CPU utilisation needs two readings some time apart, which this instant run lacks.
    assert HOST_METRICS - {"system/cpu_utilization_percentage"} <= set(logged[-1][1])
    assert sampler.error is None


def test_sampler_samples_every_interval_and_stops_after_a_failure():
    failed = threading.Event()
    steps: list[int] = []

    def log(metrics, step):
        steps.append(step)
        if len(steps) == 4:
            failed.set()
            raise ConnectionError("server gone")

    sampler = SystemMetricsSampler(log, gpu_indices=[], interval=0.05)
    sampler.start()
    assert failed.wait(10)  # four samples, 50 ms apart
    assert sampler.stop(join_timeout=10)
    sampler.sample()
    assert steps == [0, 1, 2, 3]  # no sample after the failure, not even the final one
    assert isinstance(sampler.error, ConnectionError)


def test_gpu_metrics_are_skipped_without_a_driver(monkeypatch):
    monkeypatch.setenv("FANRUN_NVML_LIBRARY", "libfanrun-no-such-nvml.so")
    logged: list[dict] = []
    sampler = SystemMetricsSampler(lambda metrics, step: logged.append(metrics), gpu_indices=[0, 1], interval=3600.0)
    sampler.start()
    assert sampler.stop(join_timeout=10)
    sampler.sample()
    assert len(logged) == 2 and not any(key.startswith("system/gpu_") for metrics in logged for key in metrics)



@distributed(num_accelerators=2)
def busy_gpus(seconds: float) -> int:
    import os
    import time

    import torch

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    block = torch.randn(8192, 8192, device="cuda")  # 256 MiB: a memory reading well above zero
    ended = time.monotonic() + seconds
    while time.monotonic() < ended:
        block = torch.tanh(block @ block)
        torch.cuda.synchronize()
    return torch.cuda.current_device()


@needs_gpus(2)
def test_gpu_utilisation_and_memory_reach_the_run(sqlite_store, monkeypatch):
    client, experiment_id = sqlite_store
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    assert busy_gpus.distributed(4.0) == [0, 1]
    fanrun.flush_tracking()
    run = only_run(client, experiment_id)
    assert run.data.params["fanrun.accelerator_type"].startswith("GPU_2x")
    for gpu in (0, 1):
        utilisation = client.get_metric_history(run.info.run_id, f"system/gpu_{gpu}_utilization_percentage")
        memory = client.get_metric_history(run.info.run_id, f"system/gpu_{gpu}_memory_usage_megabytes")
        assert len(utilisation) >= 4 and max(m.value for m in utilisation) > 50
        assert max(m.value for m in memory) > 256
        assert 0 < run.data.metrics[f"system/gpu_{gpu}_memory_usage_percentage"] <= 100


NOTEBOOK_CELL = """
import fanrun
from fanrun import distributed

@distributed(num_accelerators=2)
def ranks():
    import os
    return int(os.environ["RANK"])

print("agent before the first call:", fanrun._tracking.agent_connection.agent_pid() is not None)
print("returned", ranks.distributed())
fanrun.flush_tracking()
"""


def test_in_jupyter_the_run_is_one_link(server_store, server, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    client, experiment_id = server_store
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_CELL)])
    # A real kernel: the caller is an IPython kernel, as in a Jupyter cell.
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    html = [o.data["text/html"] for o in outputs if o.output_type == "display_data" and "text/html" in o.data]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    run = only_run(client, experiment_id)
    url = f"{server.url}/#/experiments/{experiment_id}/runs/{run.info.run_id}"
    experiment = client.get_experiment(experiment_id).name
    assert html == [
        f'fanrun: MLflow run <a href="{url}" target="_blank" rel="noopener">{run.info.run_name}</a> '
        f"({run.info.run_id}) in experiment {experiment}"
    ]
    assert "returned [0, 1]" in text
    # Started when the function was defined: the first call finds mlflow imported.
    assert "agent before the first call: True" in text
    assert "fanrun: MLflow run" not in text  # the link, not the link and a text line too
    assert run.info.status == "FINISHED"


def run_at(uri: str) -> TrackedRun:
    return TrackedRun(None, "0123abcd", "train-1a2b3c", "7", "my <exp>", uri, 0)


def test_link_for_a_server_is_its_ui_address():
    run = run_at("http://mlflow.example:5000/")
    assert link_text(run) == (
        "fanrun: MLflow run train-1a2b3c (0123abcd) in experiment my <exp>: "
        "http://mlflow.example:5000/#/experiments/7/runs/0123abcd"
    )
    assert link_html(run) == (
        'fanrun: MLflow run <a href="http://mlflow.example:5000/#/experiments/7/runs/0123abcd" '
        'target="_blank" rel="noopener">train-1a2b3c</a> (0123abcd) in experiment my &lt;exp&gt;'
    )


def test_link_for_a_local_store_says_how_to_open_it(monkeypatch, tmp_path):
    run = run_at("sqlite:////tmp/x/mlflow.db")
    assert link_text(run).endswith(": run `fanrun ui --backend-store-uri sqlite:////tmp/x/mlflow.db` to open it")
    assert link_html(run) is None  # no UI address: Jupyter shows the text line
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert link_text(run_at(f"sqlite:///{tmp_path}/fanrun/mlflow/mlflow.db")).endswith(": run `fanrun ui` to open it")
    # With a `fanrun ui` server up for the store, the run is one click away.
    served = run_at("sqlite:////tmp/x/mlflow.db")
    served.ui_url = "http://127.0.0.1:5123"
    assert link_text(served).endswith(": http://127.0.0.1:5123/#/experiments/7/runs/0123abcd")
    assert 'href="http://127.0.0.1:5123/#/experiments/7/runs/0123abcd"' in link_html(served)


def test_link_elsewhere_names_the_tracking_uri_without_its_password():
    assert link_text(run_at("databricks")).endswith(": tracking URI databricks")
    assert link_text(run_at("postgresql://ml:secret@db:5432/mlflow")).endswith(
        ": tracking URI postgresql://ml:***@db:5432/mlflow"
    )


# ---------------------------------------------------------------- one agent per process, never waited for


def agents_of(pid: int) -> list[int]:
    return [found for found, _ in tracking_agents_of(pid)]


@distributed(num_accelerators=2)
def plain_rank() -> int:
    import os

    return int(os.environ["RANK"])


def test_one_agent_serves_every_call_of_a_process(sqlite_store):
    """The agent is started by the first tracked call and kept: every later call uses the same
    process, which is still there between calls, and each call still gets a run of its own."""
    client, experiment_id = sqlite_store
    seen = []
    for _ in range(3):
        assert plain_rank.distributed() == [0, 1]
        seen.append(agents_of(os.getpid()))
    assert len(seen[0]) == 1 and seen == [seen[0]] * 3, seen
    fanrun.flush_tracking()
    runs = client.search_runs([experiment_id])
    assert len({r.info.run_id for r in runs}) == 3 and {r.info.status for r in runs} == {"FINISHED"}


CALLER_KILLED = """
import sys
from fanrun import distributed

@distributed(num_accelerators=2, tracking=False)
def untracked():
    return 1

@distributed(num_accelerators=2)
def quick():
    return 1

@distributed(num_accelerators=2)
def waits():
    import time
    print("ready", flush=True)
    time.sleep(300)

untracked.distributed()
print("untracked call done", flush=True)
sys.stdin.readline()
quick.distributed()
print("first call done", flush=True)
sys.stdin.readline()
waits.distributed()
"""


def test_the_agent_dies_with_its_caller_even_by_sigkill_and_closes_the_open_run_as_killed(server_store, tmp_path, runs_dir):
    """An untracked call starts no agent; the first tracked call starts one, which serves the next
    call too; when the caller is SIGKILLed during that call, the agent closes its run as KILLED
    (the first stays FINISHED) and exits: no process is left."""
    client, experiment_id = server_store
    env = {k: v for k, v in os.environ.items() if k != "FANRUN_TRACKING"}
    caller = subprocess.Popen([sys.executable, "-c", CALLER_KILLED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        assert caller.stdout.readline() == "untracked call done\n", caller.stderr.read()
        assert agents_of(caller.pid) == []
        caller.stdin.write("\n")
        caller.stdin.flush()
        # The call returns without waiting for its run: the run's line comes before or after.
        lines = [caller.stdout.readline(), caller.stdout.readline()]
        assert "first call done\n" in lines and any(line.startswith("fanrun: MLflow run") for line in lines), lines
        (agent,) = agents_of(caller.pid)
        caller.stdin.write("\n")
        caller.stdin.flush()
        ready = 0
        while ready < 2:
            line = caller.stdout.readline()
            assert line, caller.stderr.read()
            ready += line.endswith(": ready\n")
        assert agents_of(caller.pid) == [agent]  # the same process serves the second call
        ranks = [pid for pid, _ in processes_of_runs_under(str(runs_dir))]
        caller.kill()
        caller.wait(30)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait(30)
        caller.stdin.close()
        caller.stdout.close()
        caller.stderr.close()
    assert ranks and wait_gone([agent, *ranks], 60) == []
    statuses = {r.info.run_name.split("-")[0]: (r.info.status, r.data.tags.get("fanrun.stop_reason")) for r in client.search_runs([experiment_id])}
    assert statuses == {"quick": ("FINISHED", None), "waits": ("KILLED", "caller ended")}


@pytest.fixture
def slow_store(monkeypatch, server, tmp_path, request):
    """The real server behind a proxy that holds the requests named by the test's `slow` marker."""
    proxy = SlowProxy(server.url, request.param)
    client, experiment_id = use_store(monkeypatch, server.url, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
    yield proxy, client, experiment_id
    fanrun.flush_tracking()  # nothing of the test's runs still goes through the proxy
    proxy.stop()


RUN_CREATE = "/api/2.0/mlflow/runs/create"
RUN_UPDATE = "/api/2.0/mlflow/runs/update"


@distributed(num_accelerators=2)
def fails_at_once() -> None:
    import os
    import time

    if os.environ["RANK"] == "1":
        raise ValueError(f"raised at {time.time()!r}")
    time.sleep(60)


@pytest.mark.parametrize("slow_store", [{RUN_CREATE: 3.0}], indirect=True)
def test_a_failing_call_raises_once_its_run_is_failed_though_the_run_is_made_late(slow_store):
    """The store takes 3 s to make the run and the rank fails at once: the call raises once the
    run exists and is closed, and the run read right then is FAILED with the error as a tag."""
    proxy, client, experiment_id = slow_store
    with pytest.raises(ValueError, match="raised at"):
        fails_at_once.distributed()
    assert proxy.answered[RUN_CREATE]
    run = only_run(client, experiment_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["fanrun.error"].startswith("ValueError: [rank 1] raised at")


@pytest.mark.parametrize("slow_store", [{RUN_UPDATE: 3.0}], indirect=True)
def test_a_call_returns_once_its_run_is_closed_though_the_store_is_slow_to_close_it(slow_store, capsys):
    """The store takes 3 s to close the run: the call returns after that, with the run's line
    shown and the run FINISHED."""
    proxy, client, experiment_id = slow_store
    assert plain_rank.distributed() == [0, 1]
    returned = time.time()
    assert proxy.answered[RUN_UPDATE] and max(proxy.answered[RUN_UPDATE]) < returned
    run = only_run(client, experiment_id)
    assert run.info.status == "FINISHED"
    assert f"fanrun: MLflow run {run.info.run_name} ({run.info.run_id})" in capsys.readouterr().out


CALLER_EXITS_AT_ONCE = """
import mlflow
from fanrun import distributed

@distributed(num_accelerators=2)
def quick():
    return 1

quick.distributed()
runs = mlflow.MlflowClient({server!r}).search_runs([{experiment_id!r}])
print(f"at return {{runs[0].info.status if runs else 'not made yet'}}", flush=True)
"""


def test_a_script_that_ends_right_after_a_call_leaves_its_run_closed(server, tmp_path):
    """A script's first call, made while its agent is still starting, returns once its run is
    closed (the store takes 3 s to close it): the script's own look at the run right after the
    call sees it FINISHED, and once the script has ended its agent is gone."""
    client = MlflowClient(server.url)
    experiment_id = client.create_experiment(f"fanrun-test-{uuid.uuid4().hex[:8]}")
    proxy = SlowProxy(server.url, {RUN_UPDATE: 3.0})
    try:
        env = caller_env(tmp_path, MLFLOW_TRACKING_URI=proxy.url, MLFLOW_EXPERIMENT_ID=experiment_id)
        caller = subprocess.Popen([sys.executable, "-c", CALLER_EXITS_AT_ONCE.format(server=server.url, experiment_id=experiment_id)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
        out, err = caller.communicate(timeout=300)
    finally:
        proxy.stop()
    assert caller.returncode == 0, err
    assert "at return FINISHED" in out, out
    (run,) = client.search_runs([experiment_id])
    assert run.info.status == "FINISHED"
    assert processes_with_environment(f"MLFLOW_TRACKING_URI={proxy.url}".encode()) == []


CALLER_TIMES_CALLS = """
import json
from fanrun import distributed

@distributed(num_accelerators=2)
def tracked():
    return 1

@distributed(num_accelerators=2, tracking=False)
def untracked():
    return 1

import time
times = {"on": [], "off": []}
tracked.distributed()  # the agent's start, once per process: not what each call costs
for _ in range(5):
    for mode, function in (("off", untracked), ("on", tracked)):
        started = time.perf_counter()
        function.distributed()
        times[mode].append(time.perf_counter() - started)
print("times", json.dumps(times), flush=True)
"""
# Generous for a machine shared with other work; the goal is 5 % or 0.2 s.
LATER_CALL_BOUND_S = 0.6


@pytest.mark.slow
def test_a_later_tracked_call_costs_what_an_untracked_one_does(tmp_path):
    """After a process's first tracked call, MLflow is imported and the store open: a call whose
    ranks return at once costs, tracked, about what it costs untracked (medians of 5, interleaved)."""
    done = run_caller(CALLER_TIMES_CALLS, tmp_path)
    assert done.returncode == 0, done.stderr
    times = json.loads(done.stdout.split("times ")[1].splitlines()[0])
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    assert on <= off * 1.05 + LATER_CALL_BOUND_S, times


@distributed(num_accelerators=2)
def labelled(label: str, folder: str) -> str:
    import os
    import time
    from pathlib import Path

    import mlflow

    Path(folder, f"up-{label}-{os.environ['RANK']}").touch()
    while not Path(folder, "go").exists():
        time.sleep(0.02)
    mlflow.log_metric(f"from_{label}", 1.0)
    return mlflow.active_run().info.run_id


def test_calls_from_two_threads_at_once_get_runs_of_their_own(sqlite_store, tmp_path):
    """Two threads' calls at the same time are served by the one agent, and each gets its own run
    with its own ranks' metrics."""
    client, experiment_id = sqlite_store
    results: dict[str, object] = {}

    def call(label: str) -> None:
        try:
            results[label] = labelled.distributed(label, str(tmp_path))
        except BaseException as error:
            results[label] = error

    threads = [threading.Thread(target=call, args=(label,)) for label in ("a", "b")]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("up-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(agents_of(os.getpid())) == 1  # both calls in flight, one agent
    (tmp_path / "go").touch()
    for thread in threads:
        thread.join(120)
    assert set(results) == {"a", "b"} and all(isinstance(ids, list) and len(set(ids)) == 1 for ids in results.values()), results
    fanrun.flush_tracking()
    for label, (run_id, _) in results.items():
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert set(run.data.metrics) & {"from_a", "from_b"} == {f"from_{label}"}
    assert results["a"][0] != results["b"][0]
    assert len(client.search_runs([experiment_id])) == 2


# ---------------------------------------------------------------- the ranks' steps and stalls on the run


@distributed(num_accelerators=2)
def trains_in_steps(steps: int) -> int:
    """A DDP-like loop of `steps` steps (as many on every rank, so that their all_reduces pair up):
    a batch from a DataLoader whose every batch takes 30 ms, a step's work that takes rank 1 60 ms
    longer, the gradients averaged with all_reduce, an optimizer step."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class SlowData(torch.utils.data.Dataset):
        def __len__(self):
            return steps

        def __getitem__(self, index):
            time.sleep(0.03)
            return torch.randn(8), torch.randn(1)

    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    for features, target in torch.utils.data.DataLoader(SlowData(), batch_size=1):
        loss = torch.nn.functional.mse_loss(model(features), target)
        optimizer.zero_grad()
        loss.backward()
        if rank == 1:
            time.sleep(0.06)  # rank 0 waits for it in the all_reduce
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()
        optimizer.step()
        done += 1
    dist.destroy_process_group()
    return done


def test_each_ranks_step_time_and_its_waits_are_metrics_of_the_run_live_and_at_its_end(sqlite_store, monkeypatch):
    client, experiment_id = sqlite_store
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    assert trains_in_steps.distributed(30) == [30, 30]  # about 3 s of steps, some 100 ms each
    run = only_run(client, experiment_id)
    run_id = run.info.run_id
    # The last sample is the one taken as the run ends; host memory is in every sample.
    last_sample = max(step for step, _ in history(client, run_id, "system/system_memory_usage_megabytes"))
    figures = {}
    for rank in (0, 1):
        for name in ("step_time_s", "data_wait_fraction", "comm_wait_fraction"):
            points = history(client, run_id, f"fanrun/rank_{rank}/{name}")
            # Sampled while the ranks stepped, and once more at the end, each sample a step further.
            assert len(points) >= 2, (rank, name, points)
            assert [step for step, _ in points] == sorted({step for step, _ in points})
            assert points[-1][0] == last_sample
            figures[rank, name] = [value for _, value in points]
    for rank in (0, 1):
        # A step holds at least its batch's 30 ms, of which the DataLoader's wait is a share.
        assert all(value >= 0.03 for value in figures[rank, "step_time_s"]), figures
        for name in ("data_wait_fraction", "comm_wait_fraction"):
            assert all(0 <= value <= 1 for value in figures[rank, name]), figures
        assert statistics.median(figures[rank, "data_wait_fraction"]) > 0.1, figures
    # Rank 0 spends each step's last 60 ms waiting for rank 1 in the all_reduce.
    assert statistics.median(figures[0, "comm_wait_fraction"]) > statistics.median(figures[1, "comm_wait_fraction"])
    assert statistics.median(figures[0, "comm_wait_fraction"]) > 0.2, figures


@distributed(num_accelerators=2, stall_timeout=3, on_stall="abort")
def rank_1_sleeps() -> None:
    import os
    import time

    if os.environ["RANK"] == "1":
        time.sleep(120)


def test_a_stalled_calls_run_keeps_its_stall_report_with_the_logs(sqlite_store, tmp_path):
    client, experiment_id = sqlite_store
    with pytest.raises(fanrun.RankStalledError) as stalled:
        rank_1_sleeps.distributed()
    report = stalled.value.report
    run = only_run(client, experiment_id)
    run_id = run.info.run_id
    assert run.info.status == "FAILED"
    assert {a.path for a in client.list_artifacts(run_id, "logs")} == {
        "logs/rank_0.txt", "logs/rank_1.txt", "logs/stall-report.json", "logs/stall-report.txt"}
    text = artifact_text(client, run_id, "logs/stall-report.txt", tmp_path)
    assert text.startswith(f"run {report.run_id}: stall: {report.sentence}")
    assert "--- rank 1 ---" in text
    data = json.loads(artifact_text(client, run_id, "logs/stall-report.json", tmp_path))
    assert data["run_id"] == report.run_id and data["verdict"]["sentence"] == report.sentence
