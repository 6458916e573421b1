"""Inside a rank of a tracked call: the call's MLflow run becomes the active run as soon as the
function imports mlflow, so `mlflow.active_run()` is that run and `mlflow.log_metric` lands on it.

Run as a file by the worker, like the worker itself: standard library only, and mlflow is
never imported here, so a function that does not use mlflow does not pay for importing it.
"""

from __future__ import annotations

import importlib.util
import os
import sys


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
        _flush_before_thread_shutdown(mlflow)
    except Exception as error:
        print(
            f"fanrun: could not make MLflow run {run_id} active in rank {os.environ.get('RANK', '?')} "
            f"({type(error).__name__}: {error}); the function's mlflow calls may fail the same way.",
            file=sys.stderr,
            flush=True,
        )


def _flush_before_thread_shutdown(mlflow) -> None:
    """MLflow flushes its asynchronous logging from an atexit handler, which runs after
    concurrent.futures has shut its executors down: the last batches are lost then ("cannot
    schedule new futures after interpreter shutdown"). This flush runs just before that,
    when the function has returned or raised and its threads still work."""
    import threading

    register = getattr(threading, "_register_atexit", None)  # what concurrent.futures itself uses
    if register is not None:
        register(_flush, mlflow)


def _flush(mlflow) -> None:
    try:
        mlflow.flush_async_logging()
    except Exception as error:
        print(f"fanrun: MLflow could not send this rank's last metrics ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
