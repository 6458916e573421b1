"""One call's MLflow run, inside the tracking agent (agent.py): made (or resumed) while
the call's ranks start, told to the ranks through the call's metric socket, fed with what they
log (metric_relay.py), the machine's system metrics and the ranks' step times (rank_steps.py),
and closed with the outcome the caller sends, in a thread of its own so that the agent serves
other calls meanwhile."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import store as tracking_store
from .agent_channel import FINISH_DEADLINE_S, START_DEADLINE_S, describe
from ..backends.metric_relay import MetricRelay
from .rank_steps import RankSteps
from .rank_values import write_rank_values
from .._rank.contract import STALL_REPORT_JSON, STALL_REPORT_TEXT
from .._spec.paths import rank_log
from .links import TrackedRun, masked
from .system_metrics import SystemMetricsSampler, sampling_interval

# A tracking server that does not answer /health in this time is taken as unreachable.
PROBE_TIMEOUT_S = 3.0
# How long the end of a run waits for a system-metrics sample still in flight.
SAMPLER_JOIN_S = 5.0
# The largest run, as JSON, that goes to the ranks with its identity; theirs reads a larger one
# from the store. Well below what a rank reads of the answer (_rank/tracking.py, MAX_ANSWER).
SNAPSHOT_LIMIT = 32 * 1024
# The outcome of a call whose caller ended before sending one.
CALLER_ENDED = {"status": "KILLED", "tags": {"fanrun.stop_reason": "caller ended"}, "run_dir": None, "world_size": 0}


class CallRun:
    """One call, from its "call" message to its "closed" answer; `reply` sends to the caller."""

    def __init__(self, call: dict, listener: socket.socket, reply: Callable[[dict], None],
                 parent: CallRun | None = None) -> None:
        self.call = call
        self.id = call["id"]
        self.reply = reply
        # The submission whose run this attempt's is nested under (caller.track_submission).
        self.parent = parent
        self.run: TrackedRun | None = None
        self.snapshot: str | None = None  # the run as made, JSON of MLflow's Run message
        self.opened = threading.Event()  # set once open() has made the run, or given up
        self.relay = MetricRelay(self.write_metrics, listener)
        self.sampler: SystemMetricsSampler | None = None
        self.rank_steps = RankSteps()
        self.warnings: list[str] = []
        self._outcome: dict | None = None
        self._ended = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"fanrun-call-{self.id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def directory(self, body: dict) -> None:
        """The attempt's directory, made after the run was asked for: each sample from now on
        reads the ranks' progress records there."""
        self.rank_steps.follow(Path(body["run_dir"]), body["world_size"])

    def end(self, outcome: dict) -> None:
        """The call's outcome; the first one stands (the caller's, else CALLER_ENDED)."""
        if self._outcome is None:
            self._outcome = outcome
            self._ended.set()

    def _serve(self) -> None:
        try:
            self.relay.start()
            try:
                went_on = self.open()
            finally:
                self.opened.set()
            if went_on:
                self._ended.wait()
            self.finish(self._outcome or CALLER_ENDED)
        finally:
            self.reply({"closed": {"id": self.id, "warnings": self.warnings}})

    def open(self) -> bool:
        """Makes the run and answers the caller; False when the call ends here (run_id= names no run)."""
        call = self.call
        problem = None
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if self.parent is not None:
            # Sent before this call, so being made already; without it, the attempt's run stands alone.
            self.parent.opened.wait(START_DEADLINE_S)
            parent_run = self.parent.run if self.parent.opened.is_set() else None
            call["parent_id"] = parent_run.run_id if parent_run is not None else None
        try:
            self.run = _within(START_DEADLINE_S, self._create)
        except _RunNotFound as error:
            self.relay.publish({"run_id": None})
            self.reply({"not_found": {"id": self.id, "message": str(error)}})
            return False
        except _StoreDown as error:
            problem = f"the tracking server {masked(uri)} {error}"
        except TimeoutError as error:
            problem = f"the tracking store {masked(uri) or '(MLflow default)'} gave {error}"
        except Exception as error:
            problem = f"the tracking store {masked(uri) or '(MLflow default)'} failed ({describe(error)})"
        if problem is not None:
            self.relay.publish({"run_id": None})
            self.reply({"off": {"id": self.id, "problem": problem}})
            return True
        run = self.run
        answer = {"run_id": run.run_id, "env": _rank_variables(run)}
        if self.snapshot is not None and len(self.snapshot) <= SNAPSHOT_LIMIT:
            answer["run"] = self.snapshot  # a rank resumes it without opening the store (_rank/call_store.py)
        self.relay.publish(answer)
        if call["role"] != "submission":  # the machine is sampled on each attempt's run
            self.sampler = SystemMetricsSampler(
                _metrics_logger(run), call["gpu_indices"], sampling_interval(), first_step=run.first_system_step,
                more=self.rank_steps.read,
            )
            self.sampler.start()
        self.reply({"opened": {
            "id": self.id, "run_id": run.run_id, "run_name": run.run_name, "experiment_id": run.experiment_id,
            "experiment_name": run.experiment_name, "tracking_uri": run.tracking_uri, "ui_url": run.ui_url,
        }})
        return True

    def _create(self) -> TrackedRun:
        import mlflow

        call = self.call
        store = None
        if call["store_dir"] is not None:
            store = tracking_store.LocalStore(Path(call["store_dir"]))
            store.create()
        uri = mlflow.get_tracking_uri()
        try:
            registry_uri = mlflow.get_registry_uri() or ""
        except Exception:
            registry_uri = ""
        _probe(uri)
        run = _open_run(uri, call, store)
        run.registry_uri = registry_uri
        from mlflow.utils.proto_json_utils import message_to_json

        self.snapshot = message_to_json(run.client.get_run(run.run_id).to_proto())
        if tracking_store.is_local(uri):
            run.ui_url = tracking_store.ui_address(uri)
        return run

    def write_metrics(self, records: list[tuple]) -> None:
        """The relay's writer: the ranks' values, which arrive only once the run exists."""
        from mlflow.entities import Metric

        metrics = []
        for key, value, timestamp, step, model_id, dataset_name, dataset_digest in records:
            # Only what was set: older MLflow versions know neither models nor datasets here.
            extra = {name: v for name, v in (("model_id", model_id), ("dataset_name", dataset_name), ("dataset_digest", dataset_digest)) if v is not None}
            metrics.append(Metric(key, value, timestamp, step, **extra))
        self.run.client.log_batch(self.run.run_id, metrics=metrics)

    def finish(self, outcome: dict) -> None:
        relay, run, sampler = self.relay, self.run, self.sampler
        if run is None:
            relay.stop(FINISH_DEADLINE_S)
            return
        status = outcome["status"]
        final_sample = sampler.sample if sampler is not None and sampler.stop(SAMPLER_JOIN_S) else None
        # Every rank has ended: the last values they logged go on the run before it is closed.
        if not relay.stop(FINISH_DEADLINE_S):
            self.warnings.append(f"fanrun: the tracking store {masked(run.tracking_uri)} did not take the ranks' last "
                                 f"metrics within {FINISH_DEADLINE_S:g} s; the run is closed without them.")
        else:
            if relay.error is not None:
                self.warnings.append(f"fanrun: {relay.dropped} metric values logged by the ranks could not be written to "
                                     f"the MLflow run {run.run_name} ({describe(relay.error)}); the call's outcome is unchanged.")
            try:
                self.warnings += _within(FINISH_DEADLINE_S, write_rank_values, run.client, run.run_id, run.run_name, relay.keyed)
            except Exception as failure:
                self.warnings.append(f"fanrun: the params and tags the ranks logged could not be written to the MLflow "
                                     f"run {run.run_name} ({describe(failure)}); the call's outcome is unchanged.")
        run_dir = Path(outcome["run_dir"]) if outcome["run_dir"] else None
        try:
            _within(FINISH_DEADLINE_S, _close_run, run, final_sample, run_dir, outcome["world_size"], status, outcome["tags"],
                    outcome.get("metrics") or {}, outcome.get("params") or {})
        except Exception as failure:
            self.warnings.append(
                f"fanrun: the MLflow run {run.run_name} ({run.run_id}) could not be closed as {status} in "
                f"{masked(run.tracking_uri)} ({describe(failure)}); the call's outcome is unchanged."
            )
            return
        if sampler is not None and sampler.error is not None:
            self.warnings.append(f"fanrun: system metrics stopped early on the MLflow run {run.run_name} "
                                 f"({describe(sampler.error)}); the call's outcome is unchanged.")


def _rank_variables(run: TrackedRun) -> dict[str, str]:
    """MLflow's own variables, set in a rank when its function imports mlflow, so that a plain
    mlflow.log_metric there lands on the run."""
    env = {
        "MLFLOW_TRACKING_URI": run.tracking_uri,
        "MLFLOW_RUN_ID": run.run_id,
        "MLFLOW_EXPERIMENT_ID": run.experiment_id,
        "MLFLOW_EXPERIMENT_NAME": run.experiment_name,
    }
    # The caller's registry URI, as MLflow's own set_registry_uri passes it on: without it, every
    # log_metric call in a rank tries to import pyspark to look for one. The user's to override.
    if "MLFLOW_REGISTRY_URI" not in os.environ and run.registry_uri:
        env["MLFLOW_REGISTRY_URI"] = run.registry_uri
    return env


def _open_run(uri: str, call: dict, store: tracking_store.LocalStore | None) -> TrackedRun:
    from mlflow import MlflowClient
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
    resume = call["run_id"]
    if resume is not None:
        try:
            run = client.get_run(resume)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise _RunNotFound(
                    f"run_id={resume!r} names no MLflow run in {masked(uri)}; pass the id of an existing "
                    f"run to resume it, or leave run_id unset to start a new run"
                ) from None
            raise
        if run.info.lifecycle_stage == "deleted":
            raise _RunNotFound(f"run_id={resume!r} names a deleted MLflow run in {masked(uri)}; restore it first")
        client.update_run(run.info.run_id, status="RUNNING")
        first_step = _next_system_step(client, run.info.run_id)
    else:
        parent_id = call["parent_id"]
        experiment_id = _experiment_id(client, call["experiment_name"], parent_id, store)
        tags = {"mlflow.parentRunId": parent_id} if parent_id else {}
        try:
            from mlflow.tracking.context.registry import resolve_tags

            # The source, user and git commit that mlflow.start_run() would record.
            tags = resolve_tags(tags)
        except Exception:
            pass
        # Started when the call was, though created while its ranks started.
        run = client.create_run(experiment_id, start_time=call["started_ms"], run_name=call["run_name"], tags=tags)
        first_step = 0
    existing = run.data.params
    # Parameters cannot change on a resumed run: keep what it already has.
    new = [Param(key, value) for key, value in call["params"].items() if key not in existing]
    if new:
        client.log_batch(run.info.run_id, params=new)
    if call.get("metrics"):  # the GPU health gate's deep figures
        from mlflow.entities import Metric

        client.log_batch(run.info.run_id, metrics=[Metric(key, float(value), call["started_ms"], 0)
                                                   for key, value in call["metrics"].items()])
    experiment = client.get_experiment(run.info.experiment_id)
    return TrackedRun(
        client=client,
        run_id=run.info.run_id,
        run_name=run.info.run_name,
        experiment_id=run.info.experiment_id,
        experiment_name=experiment.name,
        tracking_uri=uri,
        first_system_step=first_step,
    )


def _experiment_id(client, experiment_name: str | None, parent_id: str | None, store: tracking_store.LocalStore | None) -> str:
    if experiment_name is None and parent_id is None and store is not None:
        # In fanrun's store, an experiment named by MLFLOW_EXPERIMENT_NAME is made here too, so
        # that its artifacts go beside the store, not into the working directory.
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or None
    if experiment_name is not None:
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            location = None
            if store is not None:
                location = (store.artifacts / re.sub(r"[^A-Za-z0-9_.-]", "_", experiment_name)).as_uri()
            return client.create_experiment(experiment_name, artifact_location=location)
        if experiment.lifecycle_stage == "deleted":
            raise RuntimeError(f"experiment {experiment_name!r} is deleted; restore it or choose another name")
        return experiment.experiment_id
    if parent_id is not None:
        # A child lives beside its parent, where the UI shows them nested.
        return client.get_run(parent_id).info.experiment_id
    # Where mlflow.start_run() would put a run: mlflow.set_experiment() (its MLFLOW_EXPERIMENT_ID),
    # MLFLOW_EXPERIMENT_NAME, a Databricks notebook's own experiment, else the default one.
    from mlflow.tracking.fluent import _get_experiment_id

    return _get_experiment_id()


def _next_system_step(client, run_id: str) -> int:
    """A resumed run's system metrics go on from the step after its last one, as MLflow's monitor does."""
    history = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    return max((m.step for m in history), default=-1) + 1


def _metrics_logger(run: TrackedRun) -> Callable[[dict[str, float], int], None]:
    from mlflow.entities import Metric

    def log(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        if batch:
            run.client.log_batch(run.run_id, metrics=batch)

    return log


def _close_run(
    run: TrackedRun, final_sample: Callable[[], None] | None, run_dir: Path | None, world_size: int, status: str,
    tags: dict[str, str], metrics: dict[str, float], params: dict[str, str]
) -> None:
    if final_sample is not None:
        final_sample()
    if metrics:  # the call's goodput ledger, on the call's run
        _metrics_logger(run)(metrics, 0)
    if params:  # known once the ranks started: the health gate's verdicts from a cluster's nodes
        from mlflow.entities import Param

        run.client.log_batch(run.run_id, params=[Param(key, value) for key, value in params.items()])
    if run_dir is not None:
        _upload_logs(run, run_dir, world_size)
    for key, value in tags.items():
        run.client.set_tag(run.run_id, key, value)
    # Last, so that a run shown as ended has everything on it.
    run.client.set_terminated(run.run_id, status)


def _upload_logs(run: TrackedRun, run_dir: Path, world_size: int) -> None:
    """Every rank's full log as logs/rank_N.txt, and the call's stall report where it stalled
    (_launch/stall_outcome.py), linked (or copied) into a private folder of that layout."""
    staging = Path(tempfile.mkdtemp(prefix="fanrun-logs-"))  # 0700
    try:
        files = [(rank_log(run_dir, rank), f"rank_{rank}.txt") for rank in range(world_size)]
        files += [(run_dir / name, name) for name in (STALL_REPORT_JSON, STALL_REPORT_TEXT)]
        for source, name in files:
            target = staging / name
            if not source.exists():
                continue
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
        run.client.log_artifacts(run.run_id, str(staging), artifact_path="logs")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _probe(uri: str) -> None:
    """Fails fast where an HTTP tracking server is down or broken, before MLflow's own retries
    (minutes of back-off) would. Any answer below 500 counts as up: auth is MLflow's to handle."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S):
            return
    except urllib.error.HTTPError as error:
        if error.code >= 500:
            raise _StoreDown(f"answers with errors (HTTP {error.code} {error.reason} for /health)") from None
    except (urllib.error.URLError, OSError) as error:
        raise _StoreDown(f"cannot be reached ({getattr(error, 'reason', error)})") from None


def _within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a helper thread, waited for at most `seconds`: a tracking call that hangs
    is left behind, and the call goes on without tracking."""
    outcome_box: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome_box["value"] = fn(*args)
        except BaseException as error:
            outcome_box["error"] = error

    thread = threading.Thread(target=target, name="fanrun-mlflow", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in outcome_box:
        raise outcome_box["error"]
    return outcome_box.get("value")


class _RunNotFound(Exception):
    """run_id= names no run: the caller's mistake, raised before anything starts."""


class _StoreDown(Exception):
    """The tracking server is down or answers with server errors."""
