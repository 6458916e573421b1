"""Inside a rank of a call that is not tracked (tracking=False, FANRUN_TRACKING=0, or a tracking
store that could not be reached): what the function logs through MLflow goes nowhere.

MLflow's fluent API starts a run of its own at the first mlflow.log_metric when none is active:
one stray, auto-named run per rank in whatever store the tracking URI names. Here the rank's
tracking URI names a store that keeps nothing: runs, parameters, metrics, tags and artifacts are
accepted (so the function runs as it would tracked) and dropped, and the first of them leaves a
mark in the run directory, from which the caller tells the user once. A function that names a
store itself (mlflow.set_tracking_uri, MlflowClient(uri)) still reaches it.

Run as a file by the rank half once the function has imported mlflow; mlflow's classes are
subclassed only then.
"""

from __future__ import annotations

import os
import time
import uuid

SCHEME = "fanrun-nowhere"
URI = f"{SCHEME}:/"


def install(mark, feed=None) -> None:
    """Registers the store and artifact repository behind URI; `mark()` is called at each write,
    and `feed(records)` (panel_feed.py) with the metrics, where the caller's panel plots them."""
    from mlflow.entities import Experiment, Run, RunData, RunInfo, RunTag
    from mlflow.store.artifact.artifact_repo import ArtifactRepository
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry
    from mlflow.store.entities.paged_list import PagedList
    from mlflow.store.tracking.abstract_store import AbstractStore
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    class NowhereStore(AbstractStore):
        """Enough of a tracking store for every run-logging call to succeed; it stores nothing
        but the runs' names and states, so that start_run, active_run and end_run behave."""

        def __init__(self) -> None:
            super().__init__()
            self._runs: dict[str, Run] = {}

        def _experiment(self, experiment_id="0", name="Default") -> Experiment:
            return Experiment(str(experiment_id), name, f"{URI}experiments/{experiment_id}", "active")

        def get_experiment(self, experiment_id):
            return self._experiment(experiment_id)

        def get_experiment_by_name(self, experiment_name):
            return self._experiment("0", experiment_name)

        def create_experiment(self, name, artifact_location=None, tags=None):
            mark()
            return "0"

        def search_experiments(self, *args, **kwargs):
            return PagedList([self._experiment()], None)

        def create_run(self, experiment_id, user_id, start_time, tags, run_name):
            mark()
            run_id = uuid.uuid4().hex
            name = run_name or next((t.value for t in tags or () if t.key == "mlflow.runName"), None) or f"run-{run_id[:6]}"
            info = RunInfo(run_id, str(experiment_id), user_id or "", "RUNNING", start_time or int(time.time() * 1000),
                           None, "active", f"{URI}runs/{run_id}", name)
            run = Run(info, RunData(tags=[*(tags or ()), RunTag("mlflow.runName", name)]))
            self._runs[run_id] = run
            return run

        def get_run(self, run_id):
            # A run resumed by id (MLFLOW_RUN_ID inherited from the caller) is one more run of nowhere.
            if run_id not in self._runs:
                info = RunInfo(run_id, "0", "", "RUNNING", int(time.time() * 1000), None, "active", f"{URI}runs/{run_id}", run_id[:8])
                self._runs[run_id] = Run(info, RunData())
            return self._runs[run_id]

        def update_run_info(self, run_id, run_status, end_time, run_name):
            old = self.get_run(run_id).info
            status = run_status if isinstance(run_status, str) else _status_name(run_status)
            info = RunInfo(run_id, old.experiment_id, old.user_id, status, old.start_time, end_time,
                           old.lifecycle_stage, old.artifact_uri, run_name or old.run_name)
            self._runs[run_id] = Run(info, RunData())
            return info

        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            mark()
            if feed is not None and metrics:
                feed([(m.key, m.value, m.timestamp, m.step) for m in metrics])

        def log_inputs(self, run_id, datasets=None, models=None):
            mark()

        def log_outputs(self, run_id, models):
            mark()

        def record_logged_model(self, run_id, mlflow_model):
            mark()

        def delete_tag(self, run_id, key):
            pass

        def get_metric_history(self, run_id, metric_key, max_results=None, page_token=None):
            return PagedList([], None)

        def _search_runs(self, *args, **kwargs):
            return [], None

        def delete_run(self, run_id):
            self._runs.pop(run_id, None)

        def restore_run(self, run_id):
            pass

        def link_traces_to_run(self, trace_ids, run_id):
            pass

    class NowhereArtifacts(ArtifactRepository):
        def log_artifact(self, local_file, artifact_path=None):
            mark()

        def log_artifacts(self, local_dir, artifact_path=None):
            mark()

        def list_artifacts(self, path=None):
            return []

        def _download_file(self, remote_file_path, local_path):
            raise FileNotFoundError(f"{remote_file_path}: this call is not tracked, so its artifacts were not kept")

    store = NowhereStore()
    _tracking_store_registry.register(SCHEME, lambda store_uri=None, artifact_uri=None: store)
    _artifact_repository_registry.register(SCHEME, NowhereArtifacts)


def _status_name(status) -> str:
    from mlflow.entities import RunStatus

    return RunStatus.to_string(status)


def marker(run_dir: str, name: str):
    """A mark() that creates run_dir/name once, the first time anything is written nowhere."""
    done = False

    def mark() -> None:
        nonlocal done
        if done:
            return
        done = True
        try:
            os.close(os.open(os.path.join(run_dir, name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        except OSError:
            pass  # the notice is lost, the function goes on

    return mark
