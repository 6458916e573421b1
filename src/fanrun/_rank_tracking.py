"""Inside a rank of a tracked call: the call's MLflow run becomes the active run as soon as the
function imports mlflow, so `mlflow.active_run()` is that run and `mlflow.log_metric` lands on it.

The metrics a rank logs on that run go to the caller over a local socket
(_rank_metric_sender.py), and the caller writes them to the tracking store (_metric_relay.py):
the rank pays for an append, not for a store's write, which costs a local sqlite store about
0.2 ms of CPU per value and would hold the rank's GIL while the loop runs.

Run as a file by the worker, like the worker itself: standard library only, and mlflow is
never imported here, so a function that does not use mlflow does not pay for importing it.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Seconds a rank's values gather before they go to the caller, unless the user set MLflow's own.
DEFAULT_BUFFER_S = 1.0


def install() -> None:
    run_id = os.environ.get("FANRUN_MLFLOW_RUN_ID")
    if not run_id:
        return
    if "mlflow" in sys.modules:
        _activate(sys.modules["mlflow"], run_id)
    else:
        sys.meta_path.insert(0, _AfterImport("mlflow", lambda module: _activate(module, run_id)))


class _AfterImport:
    """A meta path finder that lets the usual finders load one module, then calls back with it."""

    def __init__(self, name: str, callback) -> None:
        self._name = name
        self._callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)  # once only, and the real finders must not meet it again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self._callback

        def exec_then_call_back(module) -> None:
            exec_module(module)
            callback(module)

        spec.loader.exec_module = exec_then_call_back
        return spec


def _activate(mlflow, run_id: str) -> None:
    # Without this, the run would become active only at the first logging call, and
    # mlflow.active_run() would be None until then. The run is resumed, not created: the
    # caller created it and sets its final status once every rank has ended.
    try:
        if mlflow.active_run() is None:
            mlflow.start_run(run_id=run_id)
            # As MLflow does when it resumes a run from this variable: left set, it would make
            # every later start_run(nested=True) in the function resume the call's run instead.
            if os.environ.get("MLFLOW_RUN_ID") == run_id:
                del os.environ["MLFLOW_RUN_ID"]
                # MLflow forgets the active run in a forked child (a DataLoader worker): there the
                # variable makes its first log_metric resume the call's run, not start a new one.
                os.register_at_fork(after_in_child=lambda: os.environ.setdefault("MLFLOW_RUN_ID", run_id))
        _flush_before_thread_shutdown(mlflow)
    except Exception as error:
        print(
            f"fanrun: could not make MLflow run {run_id} active in rank {os.environ.get('RANK', '?')} "
            f"({type(error).__name__}: {error}); the function's mlflow calls may fail the same way.",
            file=sys.stderr,
            flush=True,
        )
        return
    relay_path = os.environ.get("FANRUN_METRICS_SOCKET")
    if relay_path:
        try:
            _send_metrics_to_caller(mlflow, run_id, relay_path)
        except Exception as error:
            # The store itself still takes them: slower, nothing lost.
            print(
                f"fanrun: rank {os.environ.get('RANK', '?')} logs its metrics straight to the tracking store "
                f"({type(error).__name__}: {error})",
                file=sys.stderr,
                flush=True,
            )


def _send_metrics_to_caller(mlflow, call_run_id: str, relay_path: str) -> None:
    """Makes this process send the metrics of the call's run to the caller, by both ways a
    metric reaches MLflow's store: the fluent mlflow.log_metric/log_metrics, and the store."""
    import runpy

    from mlflow.utils.validation import _validate_metric

    sender_class = runpy.run_path(os.path.join(os.path.dirname(__file__), "_rank_metric_sender.py"))["MetricSender"]
    buffer_s = float(os.environ.get("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS") or DEFAULT_BUFFER_S)
    sender = sender_class(relay_path, buffer_s)
    _before_thread_shutdown(sender.close)

    def send(records: list[tuple]) -> None:
        """records: (key, value, timestamp, step, model_id, dataset_name, dataset_digest)."""
        for key, value, timestamp, step, *_ in records:
            # Checked here, as the store would: a bad name or value raises in the rank's own call.
            _validate_metric(key, value, timestamp, step)
        sender.add(records)

    _route_store(call_run_id, send)
    _shortcut_fluent_logging(mlflow, call_run_id, send)


def _route_store(call_run_id: str, send) -> None:
    """MLflow's store object for the tracking URI, cached and shared by every MlflowClient, sends
    the call's run's metrics; other runs' metrics, parameters and tags still go to the store."""
    from mlflow.tracking._tracking_service.utils import _get_store
    from mlflow.utils.async_logging.run_operations import RunOperations

    store = _get_store()
    store_log_metric, store_log_batch, store_log_batch_async = store.log_metric, store.log_batch, store.log_batch_async

    def send_metrics(metrics) -> None:
        send([(m.key, float(m.value), m.timestamp, m.step, getattr(m, "model_id", None),
               getattr(m, "dataset_name", None), getattr(m, "dataset_digest", None)) for m in metrics])

    def log_metric(run_id, metric):
        if run_id != call_run_id:
            return store_log_metric(run_id, metric)
        send_metrics((metric,))

    def log_metric_async(run_id, metric):
        if run_id != call_run_id:
            return store_log_batch_async(run_id, [metric], [], [])
        send_metrics((metric,))
        return RunOperations([])

    def log_batch(run_id, metrics=(), params=(), tags=()):
        if run_id == call_run_id and metrics:
            send_metrics(metrics)
            metrics = ()
        if metrics or params or tags:
            return store_log_batch(run_id, metrics=metrics, params=params, tags=tags)

    def log_batch_async(run_id, metrics=(), params=(), tags=()):
        if run_id == call_run_id and metrics:
            send_metrics(metrics)
            metrics = ()
        if metrics or params or tags:
            return store_log_batch_async(run_id, metrics, params, tags)
        return RunOperations([])

    store.log_metric, store.log_metric_async = log_metric, log_metric_async
    store.log_batch, store.log_batch_async = log_batch, log_batch_async


def _shortcut_fluent_logging(mlflow, call_run_id: str, send) -> None:
    """mlflow.log_metric and log_metrics, in their common use (the call's run active in this
    thread, no model or dataset named), append to the buffer straight away. MLflow's own
    path to the store costs 40-80 us of the rank's CPU per call (two MlflowClient objects,
    settings read from the environment); this one a few. Any other use goes MLflow's way."""
    import functools
    import time

    from mlflow.environment_variables import MLFLOW_ENABLE_ASYNC_LOGGING
    from mlflow.tracking import fluent
    from mlflow.tracking.metric_value_conversion_utils import convert_metric_value_to_float_if_possible
    from mlflow.utils.async_logging.run_operations import RunOperations

    mlflow_log_metric, mlflow_log_metrics = mlflow.log_metric, mlflow.log_metrics

    def on_call_run() -> bool:
        active = mlflow.active_run()
        if active is None or active.info.run_id != call_run_id or fluent.get_active_model_id() is not None:
            return False
        # A model logged on the run at a step links that step's metrics to it: MLflow's way.
        outputs = active.outputs
        return not (outputs and outputs.model_outputs)

    def result(synchronous):
        asynchronous = not synchronous if synchronous is not None else MLFLOW_ENABLE_ASYNC_LOGGING.get()
        return RunOperations([]) if asynchronous else None

    @functools.wraps(mlflow_log_metric)
    def log_metric(key, value, step=None, synchronous=None, timestamp=None, *more, **named):
        if more or any(v is not None for v in named.values()) or not on_call_run():
            return mlflow_log_metric(key, value, step, synchronous, timestamp, *more, **named)
        value = convert_metric_value_to_float_if_possible(value)
        send([(key, value, timestamp or int(time.time() * 1000), step or 0, None, None, None)])
        return result(synchronous)

    @functools.wraps(mlflow_log_metrics)
    def log_metrics(metrics, step=None, synchronous=None, *more, timestamp=None, **named):
        if more or any(v is not None for v in named.values()) or not on_call_run():
            return mlflow_log_metrics(metrics, step, synchronous, *more, timestamp=timestamp, **named)
        timestamp, step = timestamp or int(time.time() * 1000), step or 0
        send([(key, convert_metric_value_to_float_if_possible(value), timestamp, step, None, None, None)
              for key, value in metrics.items()])
        return result(synchronous)

    mlflow.log_metric, mlflow.log_metrics = log_metric, log_metrics


def _flush_before_thread_shutdown(mlflow) -> None:
    """MLflow flushes its asynchronous logging from an atexit handler, which runs after
    concurrent.futures has shut its executors down: the last batches are lost then ("cannot
    schedule new futures after interpreter shutdown"). This flush runs before that."""
    _before_thread_shutdown(_flush, mlflow)


def _before_thread_shutdown(fn, *args) -> None:
    """Calls fn when the function has returned or raised and the rank's threads still work."""
    import threading

    register = getattr(threading, "_register_atexit", None)  # what concurrent.futures itself uses
    if register is not None:
        register(fn, *args)


def _flush(mlflow) -> None:
    try:
        mlflow.flush_async_logging()
    except Exception as error:
        print(f"fanrun: MLflow could not send this rank's last metrics ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
