"""Every .distributed() call is an MLflow run that all ranks log to: real MLflow, against a local
sqlite store and a real `mlflow server`, read back through MlflowClient."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from gpus import needs_gpus
from mlflow_server import MlflowServer
from server_process import free_port

import fanrun
from fanrun import distributed
from fanrun._system_metrics import SystemMetricsSampler
from fanrun._tracking import TrackingWarning, _Run, link_html, link_text, outcome

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

    return os.environ.get("FANRUN_MLFLOW_RUN_ID"), os.environ.get("MLFLOW_RUN_ID")


# ---------------------------------------------------------------- one run, every rank


def check_trained_run(client, experiment_id, run_ids, tmp_path):
    run = only_run(client, experiment_id)
    run_id = run.info.run_id
    # Every rank's active run is the call's run, and both ranks' metrics are on it.
    assert run_ids == [run_id, run_id]
    assert history(client, run_id, "loss") == sorted([(s, float(s)) for s in range(3)] + [(s, 10.0 + s) for s in range(3)])
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
        f"open it with `mlflow ui --backend-store-uri {sqlite_uri}`\n"
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


@distributed(num_accelerators=2)
def log_every_way():
    """Each way a function logs metrics: they travel through the caller, and must all arrive."""
    import os

    import mlflow

    import numpy

    rank = int(os.environ["RANK"])
    run_id = mlflow.active_run().info.run_id
    mlflow.log_metrics({"accuracy": 0.5 + rank, "lr": 0.1}, step=1)
    mlflow.log_metric("numpy_value", numpy.float32(2.5), step=1)
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
    outer = [r for r in client.search_runs([experiment_id]) if r.info.run_name.startswith("log_every_way-")]
    assert len(outer) == 1, [(r.info.run_name, r.info.lifecycle_stage) for r in client.search_runs([experiment_id])]
    run_id = outer[0].info.run_id
    assert history(client, run_id, "accuracy") == [(1, 0.5), (1, 1.5)]
    assert history(client, run_id, "lr") == [(1, 0.1), (1, 0.1)]
    assert history(client, run_id, "numpy_value") == [(1, 2.5), (1, 2.5)]
    timed = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, "timed"))
    assert timed == [(5, 1_700_000_000_123, 1.0), (5, 1_700_000_000_123, 2.0)]
    assert history(client, run_id, "client_metric") == [(2, 3.0), (2, 4.0)]
    assert history(client, run_id, "from_forked_worker") == [(3, 7.0), (3, 8.0)]
    assert "inner_metric" not in client.get_run(run_id).data.metrics
    for rank, (inner_id, bad_name_error) in enumerate(results):
        assert history(client, inner_id, "inner_metric") == [(4, 5.0 + rank)]
        assert client.get_run(inner_id).data.tags["mlflow.parentRunId"] == run_id
        # A bad name fails in the rank's own call, as it would without fanrun.
        assert bad_name_error is not None and "bad name!*" in bad_name_error


def test_without_configuration_the_local_default_store_is_used(tmp_path, capsys):
    @distributed(num_accelerators=2)
    def log_one():
        import mlflow

        mlflow.log_metric("one", 1.0)

    log_one.distributed()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (tmp_path / "mlflow.db").exists()
    runs = MlflowClient(uri).search_runs(["0"])
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert runs[0].data.metrics["one"] == 1.0
    assert "mlflow ui --backend-store-uri sqlite:" in capsys.readouterr().out


def test_experiment_name_argument_chooses_the_experiment(sqlite_store, sqlite_uri):
    client, other_experiment = sqlite_store
    name = f"fanrun-named-{uuid.uuid4().hex[:8]}"

    @distributed(num_accelerators=2, experiment_name=name)
    def named():
        return 1

    assert named.distributed() == [1, 1]
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    assert [r.info.status for r in client.search_runs([experiment.experiment_id])] == ["FINISHED"]
    assert client.search_runs([other_experiment]) == []


# ---------------------------------------------------------------- nesting and resuming


def test_a_call_inside_an_active_run_is_its_child(sqlite_store):
    client, experiment_id = sqlite_store
    with mlflow.start_run(run_name="parent") as parent:
        run_ids = train.distributed(2)
        assert mlflow.active_run().info.run_id == parent.info.run_id  # the caller's run is untouched
    child = client.get_run(run_ids[0])
    assert child.info.run_id != parent.info.run_id
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id == experiment_id
    assert child.info.status == "FINISHED"
    assert len(history(client, child.info.run_id, "loss")) == 4
    assert client.get_metric_history(parent.info.run_id, "loss") == []


def test_run_id_resumes_that_run_and_start_run_with_it_nests_under_it(sqlite_store):
    client, experiment_id = sqlite_store
    earlier = client.create_run(experiment_id, run_name="earlier")
    client.log_metric(earlier.info.run_id, "loss", 99.0, step=0)
    client.set_terminated(earlier.info.run_id, "FAILED")

    resumed = distributed(num_accelerators=2, run_id=earlier.info.run_id)(train.__wrapped__)
    assert resumed.distributed(2) == [earlier.info.run_id] * 2
    again = client.get_run(earlier.info.run_id)
    assert again.info.status == "FINISHED"
    assert (0, 99.0) in history(client, earlier.info.run_id, "loss")
    assert len(history(client, earlier.info.run_id, "loss")) == 5
    assert len(client.search_runs([experiment_id])) == 1  # resumed, not a new run

    with mlflow.start_run(run_id=earlier.info.run_id):
        child_ids = train.distributed(1)
    child = client.get_run(child_ids[0])
    assert child.data.tags["mlflow.parentRunId"] == earlier.info.run_id


def test_run_id_that_names_no_run_is_an_error_before_anything_starts(sqlite_store, runs_dir):
    before = set(runs_dir.iterdir())

    @distributed(num_accelerators=2, run_id="0123456789abcdef0123456789abcdef")
    def never():
        return 1

    with pytest.raises(ValueError, match=r"run_id='0123456789abcdef0123456789abcdef' names no MLflow run in sqlite:"):
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
    assert untracked.distributed() == [(None, None), (None, None)]
    assert client.search_runs([experiment_id]) == []
    assert "MLflow" not in capsys.readouterr().out


def test_fanrun_tracking_0_turns_the_default_off(sqlite_store, monkeypatch):
    client, experiment_id = sqlite_store
    monkeypatch.setenv("FANRUN_TRACKING", "0")

    @distributed(num_accelerators=2)
    def tracked_by_default():
        import os

        return os.environ.get("FANRUN_MLFLOW_RUN_ID")

    assert tracked_by_default.distributed() == [None, None]
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
    run = only_run(client, experiment_id)
    assert run.data.params["fanrun.accelerator_type"].startswith("GPU_2x")
    for gpu in (0, 1):
        utilisation = client.get_metric_history(run.info.run_id, f"system/gpu_{gpu}_utilization_percentage")
        memory = client.get_metric_history(run.info.run_id, f"system/gpu_{gpu}_memory_usage_megabytes")
        assert len(utilisation) >= 4 and max(m.value for m in utilisation) > 50
        assert max(m.value for m in memory) > 256
        assert 0 < run.data.metrics[f"system/gpu_{gpu}_memory_usage_percentage"] <= 100


NOTEBOOK_CELL = """
from fanrun import distributed

@distributed(num_accelerators=2)
def ranks():
    import os
    return int(os.environ["RANK"])

print("returned", ranks.distributed())
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
    assert "fanrun: MLflow run" not in text  # the link, not the link and a text line too
    assert run.info.status == "FINISHED"


def run_at(uri: str) -> _Run:
    return _Run(None, "0123abcd", "train-1a2b3c", "7", "my <exp>", uri, 0)


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


def test_link_for_a_local_store_says_how_to_open_it():
    run = run_at("sqlite:////tmp/x/mlflow.db")
    assert link_text(run).endswith(": open it with `mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db`")
    assert link_html(run) is None  # no UI address: Jupyter shows the text line


def test_link_elsewhere_names_the_tracking_uri_without_its_password():
    assert link_text(run_at("databricks")).endswith(": tracking URI databricks")
    assert link_text(run_at("postgresql://ml:secret@db:5432/mlflow")).endswith(
        ": tracking URI postgresql://ml:***@db:5432/mlflow"
    )
