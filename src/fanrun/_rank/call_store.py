"""The tracking store as a rank sees it, for the call's run: what the call's run needs is served
here, and MLflow's own store for the tracking URI is opened only when the function asks for
something else (another run, an artifact, a search).

Opening MLflow's store is most of what tracking costs a rank: a sqlite store imports SQLAlchemy
and Alembic and checks the database's schema, seconds on a small machine, on every rank of
every call. The call's run needs none of it:
- its metrics, and the params and tags the function logs on it, go to the caller's agent over
  the rank's socket (metric_sender.py), which writes them (backends/metric_relay.py,
  _tracking/rank_values.py);
- its status and end time are the agent's to set once every rank has ended. Written by a rank,
  they would be RUNNING at every start_run that resumes the run, and FINISHED at the exit of a
  rank that failed; each such write rewrites a file store's meta.yaml in place, truncated
  first, so that the agent's writes fail while it is rewritten, and a rank stopped (SIGTERM)
  in the middle leaves it empty;
- the run itself, which start_run() reads to resume it, comes with the agent's answer.
A run the function starts itself is ended as MLflow ends it; renaming the call's run still
renames it.

Run by path from tracking.py; mlflow is imported only once the function has imported it."""

from __future__ import annotations

import json
import threading


class CallStore:
    """Stands in MLflow's registry for the store of the rank's tracking URI: `send(records)`
    takes the call's run's metrics (None: the store does), `keyed` (a KeyedValues, or None: the
    store) its params and tags; `snapshot` is the run as the agent made it (None: the store has
    it); `open_store()` opens MLflow's own."""

    def __init__(self, run_id: str, snapshot, send, keyed, open_store) -> None:
        self._run_id, self._snapshot = run_id, snapshot
        self._send, self._keyed, self._open = send, keyed, open_store
        self._store = None
        self._lock = threading.Lock()

    @classmethod
    def install(cls, run_id: str, snapshot, send, keyed) -> CallStore:
        """Makes MLflow's registry hand this store out for the tracking URI of this rank."""
        from mlflow.tracking._tracking_service import utils

        registry = utils._tracking_store_registry
        # Its class's own, even where an earlier call of this process left its replacement.
        registry_get_store = type(registry).get_store.__get__(registry)
        uri = utils._resolve_tracking_uri()
        store = cls(run_id, snapshot, send, keyed, lambda: registry_get_store(uri))

        def get_store(store_uri=None, artifact_uri=None):
            if artifact_uri is None and utils._resolve_tracking_uri(store_uri) == uri:
                return store
            return registry_get_store(store_uri, artifact_uri)

        registry.get_store = get_store
        return store

    def uninstall(self) -> None:
        """The registry's own again, MLflow's store flushed of what it queued."""
        from mlflow.tracking._tracking_service import utils

        utils._tracking_store_registry.__dict__.pop("get_store", None)  # its class's method again
        self.flush_async_logging()

    def _real(self):
        with self._lock:
            if self._store is None:
                self._store = self._open()
            return self._store

    def __getattr__(self, name: str):
        # Everything this class does not serve itself is MLflow's store's.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._real(), name)

    # ------------------------------------------------------------------ the run itself

    def get_run(self, run_id):
        if run_id == self._run_id and self._snapshot is not None and self._store is None:
            return self._snapshot
        return self._real().get_run(run_id)

    def update_run_info(self, run_id, run_status, end_time, run_name):
        if run_id != self._run_id:
            return self._real().update_run_info(run_id, run_status, end_time, run_name)
        if not run_name and self._snapshot is not None:
            return self._snapshot.info
        from mlflow.entities import RunStatus

        store = self._real()
        info = store.get_run(run_id).info
        if not run_name:
            return info
        return store.update_run_info(run_id, RunStatus.from_string(info.status), info.end_time, run_name)

    # ------------------------------------------------------------------ what is logged on it

    def log_metric(self, run_id, metric):
        if run_id != self._run_id or self._send is None:
            return self._real().log_metric(run_id, metric)
        self._send_metrics((metric,))

    def log_metric_async(self, run_id, metric):
        if run_id != self._run_id or self._send is None:
            return self._real().log_batch_async(run_id, [metric], [], [])
        self._send_metrics((metric,))
        return _done()

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        metrics, params, tags = self._split(run_id, metrics, params, tags)
        if metrics or params or tags:
            return self._real().log_batch(run_id, metrics=metrics, params=params, tags=tags)

    def log_batch_async(self, run_id, metrics=(), params=(), tags=()):
        metrics, params, tags = self._split(run_id, metrics, params, tags)
        if metrics or params or tags:
            return self._real().log_batch_async(run_id, metrics, params, tags)
        return _done()

    def log_param(self, run_id, param):
        return self.log_batch(run_id, params=[param])

    def log_param_async(self, run_id, param):
        return self.log_batch_async(run_id, params=[param])

    def set_tag(self, run_id, tag):
        return self.log_batch(run_id, tags=[tag])

    def set_tag_async(self, run_id, tag):
        return self.log_batch_async(run_id, tags=[tag])

    # A store never opened has queued nothing: MLflow's exit and end_run flush it.
    def flush_async_logging(self):
        if self._store is not None:
            return self._store.flush_async_logging()

    def end_async_logging(self):
        if self._store is not None:
            return self._store.end_async_logging()

    def shut_down_async_logging(self):
        if self._store is not None:
            return self._store.shut_down_async_logging()

    def _split(self, run_id, metrics, params, tags):
        """Sends what goes to the caller; returns what still goes to MLflow's store."""
        if run_id != self._run_id:
            return metrics, params, tags
        if metrics and self._send is not None:
            self._send_metrics(metrics)
            metrics = ()
        if self._keyed is not None:
            params, tags = self._keyed.send(params, tags)
        return metrics, params, tags

    def _send_metrics(self, metrics) -> None:
        self._send([(m.key, float(m.value), m.timestamp, m.step, getattr(m, "model_id", None),
                     getattr(m, "dataset_name", None), getattr(m, "dataset_digest", None)) for m in metrics])


def _done():
    from mlflow.utils.async_logging.run_operations import RunOperations

    return RunOperations([])


def run_from_json(text: str | None):
    """The agent's run (a JSON of MLflow's Run message) as MLflow's Run, or None without one."""
    if not text:
        return None
    from mlflow.entities import Run
    from mlflow.protos.service_pb2 import Run as RunMessage
    from mlflow.utils.proto_json_utils import parse_dict

    message = RunMessage()
    parse_dict(json.loads(text), message)
    return Run.from_proto(message)
