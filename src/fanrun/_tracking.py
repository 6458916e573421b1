"""The MLflow run of one .distributed() call: started in the caller before the ranks, inherited by
every rank, ended with the call's outcome; parameters, rank logs and system metrics logged on it.

mlflow is imported here only when a call is tracked, never by `import fanrun`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import os
import secrets
import shutil
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ._accelerators import Plan
from ._errors import RunTimeoutError
from ._metric_relay import MetricRelay
from ._paths import RunPaths
from ._system_metrics import SystemMetricsSampler, sampling_interval

# A tracking server that does not answer /health in this time is taken as unreachable.
PROBE_TIMEOUT_S = 3.0
# Bounds on the caller's own MLflow calls: a stalled server costs this much, never a hang.
START_DEADLINE_S = 20.0
FINISH_DEADLINE_S = 60.0
# How long the end of a run waits for a system-metrics sample still in flight.
SAMPLER_JOIN_S = 5.0
# MLflow refuses longer tag values (5000 characters on some stores).
MAX_TAG_CHARS = 4000
# What the ranks get when tracking is off for a call: their own mlflow calls then go to a
# private in-memory store, so a dead server neither stalls nor crashes the training.
DROPPED_TRACKING_URI = "sqlite:///:memory:"
_OFF_VALUES = {"0", "false", "no", "off"}
_notice_lock = threading.Lock()
_notice_shown = False


class TrackingWarning(UserWarning):
    """MLflow tracking could not be done for a call; the call itself went on."""


@dataclasses.dataclass
class TrackedCall:
    """What DistributedFunction.distributed hands to the launcher, tracked or not."""

    rank_env: dict[str, str] = dataclasses.field(default_factory=dict)
    paths: RunPaths | None = None

    def attach_paths(self, paths: RunPaths) -> None:
        self.paths = paths


@dataclasses.dataclass
class _Run:
    client: Any
    run_id: str
    run_name: str
    experiment_id: str
    experiment_name: str
    tracking_uri: str
    first_system_step: int
    registry_uri: str = ""


def enabled(tracking: bool) -> bool:
    """tracking=True unless FANRUN_TRACKING=0 turns tracking off for the whole process."""
    return tracking and os.environ.get("FANRUN_TRACKING", "1").strip().lower() not in _OFF_VALUES


@contextlib.contextmanager
def track(*, function_name: str, plan: Plan, gpu_indices: list[int], options: Any) -> Iterator[TrackedCall]:
    """Starts the call's MLflow run (or not), yields what the ranks need, and ends the run with
    the call's outcome: FINISHED, KILLED (interrupt, timeout) or FAILED (anything else)."""
    call = TrackedCall()
    mlflow = _import_mlflow() if enabled(options.tracking) else None
    if mlflow is None:
        yield call
        return
    run = _start(mlflow, function_name, plan, options)
    if run is None:
        call.rank_env = {"MLFLOW_TRACKING_URI": DROPPED_TRACKING_URI, "MLFLOW_RUN_ID": ""}
        yield call
        return
    call.rank_env = rank_environment(run)
    relay = _start_relay(run)
    if relay is not None:
        call.rank_env["FANRUN_METRICS_SOCKET"] = relay.path
    _announce(run)
    sampler = SystemMetricsSampler(
        _metrics_logger(run), gpu_indices, sampling_interval(), first_step=run.first_system_step
    )
    sampler.start()
    try:
        yield call
    except BaseException as error:
        _finish(run, sampler, relay, call.paths, plan.world_size, error)
        raise
    _finish(run, sampler, relay, call.paths, plan.world_size, None)


def rank_environment(run: _Run) -> dict[str, str]:
    """MLflow's own variables, so that a plain mlflow.log_metric in any rank lands on the run."""
    env = {
        "MLFLOW_TRACKING_URI": run.tracking_uri,
        "MLFLOW_RUN_ID": run.run_id,
        "MLFLOW_EXPERIMENT_ID": run.experiment_id,
        "MLFLOW_EXPERIMENT_NAME": run.experiment_name,
        # Read by the worker: the run becomes the active run when the function imports mlflow.
        "FANRUN_MLFLOW_RUN_ID": run.run_id,
        # The caller samples the machine once for the run; a monitor in every rank would
        # write the same metric names N times over.
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
    }
    # Each default below is the user's to override. Logging every step must not slow the
    # loop (docs/benchmarks.md has the figures): the run's metrics go through the caller
    # (_metric_relay.py), and MLflow's synchronous path, which costs a rank less per call
    # than its asynchronous one, stays the default.
    defaults = {
        # The caller's registry URI, as MLflow's own set_registry_uri passes it on: without it,
        # every log_metric call in a rank tries to import pyspark to look for one.
        "MLFLOW_REGISTRY_URI": run.registry_uri,
        # Each rank ends its MLflow session at exit, and MLflow would print the run's link from
        # every one of them; the caller has shown it once already.
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    }
    for key, value in defaults.items():
        if key not in os.environ and value:
            env[key] = value
    return env


def _import_mlflow():
    global _notice_shown
    try:
        import mlflow
    except ImportError:
        with _notice_lock:
            if not _notice_shown:
                _notice_shown = True
                print(
                    "fanrun: MLflow is not installed, so this call is not tracked "
                    "(pip install mlflow to track it; tracking=False hides this notice).",
                    file=sys.stderr,
                    flush=True,
                )
        return None
    return mlflow


def _start(mlflow, function_name: str, plan: Plan, options: Any) -> _Run | None:
    """The run, created or resumed; None (after one warning) where the tracking store fails."""
    uri = mlflow.get_tracking_uri()
    shown = masked(uri)
    try:
        registry_uri = mlflow.get_registry_uri() or ""
    except Exception:
        registry_uri = ""
    # Thread-local in MLflow: read here, in the caller's thread.
    active = mlflow.active_run()
    parent_id = active.info.run_id if active is not None else (os.environ.get("MLFLOW_RUN_ID") or None)
    try:
        _probe(uri)
        run = _within(START_DEADLINE_S, _open_run, uri, function_name, plan, options, parent_id)
        run.registry_uri = registry_uri
        return run
    except _RunNotFound as error:
        raise ValueError(str(error)) from None
    except _StoreDown as error:
        problem = f"the tracking server {shown} {error}"
    except TimeoutError as error:
        problem = f"the tracking store {shown} gave {error}"
    except Exception as error:
        problem = f"the tracking store {shown} failed ({_describe(error)})"
    _warn(
        f"fanrun: MLflow tracking is off for this call of {function_name!r}: {problem}. The function "
        f"still runs on every rank; what it logs with mlflow is dropped. Check the tracking server, "
        f"or pass tracking=False to @distributed to run without it."
    )
    return None


def _open_run(uri: str, function_name: str, plan: Plan, options: Any, parent_id: str | None) -> _Run:
    from mlflow import MlflowClient
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
    if options.run_id is not None:
        try:
            run = client.get_run(options.run_id)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise _RunNotFound(
                    f"run_id={options.run_id!r} names no MLflow run in {masked(uri)}; pass the id of an existing "
                    f"run to resume it, or leave run_id unset to start a new run"
                ) from None
            raise
        if run.info.lifecycle_stage == "deleted":
            raise _RunNotFound(f"run_id={options.run_id!r} names a deleted MLflow run in {masked(uri)}; restore it first")
        client.update_run(run.info.run_id, status="RUNNING")
        first_step = _next_system_step(client, run.info.run_id)
    else:
        experiment_id = _experiment_id(client, options.experiment_name, parent_id)
        tags = {"mlflow.parentRunId": parent_id} if parent_id else {}
        try:
            from mlflow.tracking.context.registry import resolve_tags

            # The source, user and git commit that mlflow.start_run() would record.
            tags = resolve_tags(tags)
        except Exception:
            pass
        run_name = f"{function_name}-{secrets.token_hex(3)}"
        run = client.create_run(experiment_id, run_name=run_name, tags=tags)
        first_step = 0
    params = _parameters(function_name, plan, options)
    existing = run.data.params
    # Parameters cannot change on a resumed run: keep what it already has.
    new = [Param(key, value) for key, value in params.items() if key not in existing]
    if new:
        client.log_batch(run.info.run_id, params=new)
    experiment = client.get_experiment(run.info.experiment_id)
    return _Run(
        client=client,
        run_id=run.info.run_id,
        run_name=run.info.run_name,
        experiment_id=run.info.experiment_id,
        experiment_name=experiment.name,
        tracking_uri=uri,
        first_system_step=first_step,
    )


def _experiment_id(client, experiment_name: str | None, parent_id: str | None) -> str:
    if experiment_name is not None:
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            return client.create_experiment(experiment_name)
        if experiment.lifecycle_stage == "deleted":
            raise RuntimeError(f"experiment {experiment_name!r} is deleted; restore it or choose another name")
        return experiment.experiment_id
    if parent_id is not None:
        # A child lives beside its parent, where the UI shows them nested.
        return client.get_run(parent_id).info.experiment_id
    # Where mlflow.start_run() would put a run: mlflow.set_experiment(), MLFLOW_EXPERIMENT_NAME
    # or _ID, a Databricks notebook's own experiment, else the default one.
    from mlflow.tracking.fluent import _get_experiment_id

    return _get_experiment_id()


def _parameters(function_name: str, plan: Plan, options: Any) -> dict[str, str]:
    from . import __version__

    return {
        "fanrun.function": function_name,
        "fanrun.world_size": str(plan.world_size),
        "fanrun.num_accelerators": str(plan.world_size),
        "fanrun.accelerator_type": plan.accelerator_type,
        "fanrun.accelerators": plan.description,
        "fanrun.timeout_s": "none" if options.timeout is None else f"{options.timeout:g}",
        "fanrun.version": __version__,
    }


def _next_system_step(client, run_id: str) -> int:
    """A resumed run's system metrics go on from the step after its last one, as MLflow's monitor does."""
    history = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    return max((m.step for m in history), default=-1) + 1


def _start_relay(run: _Run) -> MetricRelay | None:
    """The caller's end of the ranks' metric sockets; None (the ranks then write to the store
    themselves, more slowly) where no socket can be made."""
    from mlflow.entities import Metric

    def write(records: list[tuple]) -> None:
        metrics = []
        for key, value, timestamp, step, model_id, dataset_name, dataset_digest in records:
            # Only what was set: older MLflow versions know neither models nor datasets here.
            extra = {name: v for name, v in (("model_id", model_id), ("dataset_name", dataset_name), ("dataset_digest", dataset_digest)) if v is not None}
            metrics.append(Metric(key, value, timestamp, step, **extra))
        run.client.log_batch(run.run_id, metrics=metrics)

    try:
        relay = MetricRelay(write)
    except OSError as error:
        print(f"fanrun: each rank writes its metrics to the tracking store itself ({_describe(error)})", file=sys.stderr, flush=True)
        return None
    relay.start()
    return relay


def _metrics_logger(run: _Run) -> Callable[[dict[str, float], int], None]:
    from mlflow.entities import Metric

    def log(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        if batch:
            run.client.log_batch(run.run_id, metrics=batch)

    return log


def _finish(
    run: _Run, sampler: SystemMetricsSampler, relay: MetricRelay | None, paths: RunPaths | None, world_size: int, error: BaseException | None
) -> None:
    status, tags = outcome(error)
    final_sample = sampler.sample if sampler.stop(SAMPLER_JOIN_S) else None
    # Every rank has ended: the last values they logged go on the run before it is closed.
    if relay is not None:
        if not relay.stop(FINISH_DEADLINE_S):
            _warn(f"fanrun: the tracking store {masked(run.tracking_uri)} did not take the ranks' last metrics "
                  f"within {FINISH_DEADLINE_S:g} s; the run is closed without them.")
        elif relay.error is not None:
            _warn(f"fanrun: {relay.dropped} metric values logged by the ranks could not be written to the MLflow run "
                  f"{run.run_name} ({_describe(relay.error)}); the call's outcome is unchanged.")
    try:
        _within(FINISH_DEADLINE_S, _close_run, run, final_sample, paths, world_size, status, tags)
    except Exception as failure:
        _warn(
            f"fanrun: the MLflow run {run.run_name} ({run.run_id}) could not be closed as {status} in "
            f"{masked(run.tracking_uri)} ({_describe(failure)}); the call's outcome is unchanged."
        )
        return
    if sampler.error is not None:
        _warn(
            f"fanrun: system metrics stopped early on the MLflow run {run.run_name} "
            f"({_describe(sampler.error)}); the call's outcome is unchanged."
        )


def outcome(error: BaseException | None) -> tuple[str, dict[str, str]]:
    """The run's end status for how the call ended, and the tags that say why."""
    if error is None:
        return "FINISHED", {}
    if isinstance(error, RunTimeoutError):
        return "KILLED", {"fanrun.stop_reason": "timeout"}
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return "KILLED", {"fanrun.stop_reason": "interrupted"}
    message = f"{type(error).__name__}: {error}"
    if len(message) > MAX_TAG_CHARS:
        message = message[: MAX_TAG_CHARS - 3] + "..."
    tags = {"fanrun.error": message}
    rank = getattr(error, "rank", None)
    if isinstance(rank, int):
        tags["fanrun.failed_rank"] = str(rank)
    return "FAILED", tags


def _close_run(
    run: _Run, final_sample: Callable[[], None] | None, paths: RunPaths | None, world_size: int, status: str, tags: dict[str, str]
) -> None:
    if final_sample is not None:
        final_sample()
    if paths is not None:
        _upload_logs(run, paths, world_size)
    for key, value in tags.items():
        run.client.set_tag(run.run_id, key, value)
    # Last, so that a run shown as ended has everything on it.
    run.client.set_terminated(run.run_id, status)


def _upload_logs(run: _Run, paths: RunPaths, world_size: int) -> None:
    """Every rank's full log as logs/rank_N.txt, linked (not copied) into a folder of that layout."""
    staging = paths.directory / "mlflow-logs"
    staging.mkdir(mode=0o700, exist_ok=True)
    try:
        for rank in range(world_size):
            source, target = paths.log(rank), staging / f"rank_{rank}.txt"
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


# ---------------------------------------------------------------- where the run is shown


def run_url(run: _Run) -> str | None:
    """The run's page in the tracking server's UI, which serves at the tracking URI itself."""
    if not run.tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{masked(run.tracking_uri).rstrip('/')}/#/experiments/{run.experiment_id}/runs/{run.run_id}"


def link_text(run: _Run) -> str:
    where = run_url(run)
    if where is None:
        uri = masked(run.tracking_uri)
        scheme = urllib.parse.urlsplit(run.tracking_uri).scheme
        if scheme in ("sqlite", "file") or (not scheme and ("/" in uri or uri.startswith("."))):
            where = f"open it with `mlflow ui --backend-store-uri {uri}`"
        else:
            where = f"tracking URI {uri}"
    return f"fanrun: MLflow run {run.run_name} ({run.run_id}) in experiment {run.experiment_name}: {where}"


def masked(uri: str) -> str:
    """The URI without a password, for printing: a database or server URI may carry one."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = f"{parts.username}:***@" + parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def link_html(run: _Run) -> str | None:
    url = run_url(run)
    if url is None:
        return None
    return (
        f"fanrun: MLflow run <a href=\"{html.escape(url, quote=True)}\" target=\"_blank\" rel=\"noopener\">"
        f"{html.escape(run.run_name)}</a> ({html.escape(run.run_id)}) in experiment "
        f"{html.escape(run.experiment_name)}"
    )


def _announce(run: _Run) -> None:
    markup = link_html(run)
    if markup is not None and _in_jupyter_kernel():
        try:
            from IPython.display import HTML, display

            display(HTML(markup))
            return
        except Exception:
            pass  # a front end that cannot show HTML still gets the line below
    print(link_text(run), file=sys.stdout, flush=True)


def _in_jupyter_kernel() -> bool:
    # Only where IPython is already loaded: a plain script never pays for importing it.
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


# ---------------------------------------------------------------- warnings


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _warn(message: str) -> None:
    """Warns at the user's line that called .distributed(), not at fanrun's own frames."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(0), 1
    while frame is not None and (frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, TrackingWarning, stacklevel=level)
