"""Inside a rank: the call's MLflow run becomes the active run as soon as the function imports
mlflow, so `mlflow.active_run()` is that run and `mlflow.log_metric` lands on it.

The run is made while the ranks start (by the caller's agent, _tracking/agent.py), so a rank
learns it only when it needs it: the first `import mlflow` connects to the socket FANRUN_MLFLOW
names and waits for the answer, the run's identity or "not tracked"; then MLflow's variables
are set and the import goes on. A function that never imports mlflow never asks, and never waits.

The metrics, params and tags a rank logs on that run go over the same socket
(metric_sender.py), and the agent writes them to the tracking store (backends/metric_relay.py):
the rank pays for an append, not for a store's write, which costs a local sqlite store about
0.2 ms of CPU per value and would hold the rank's GIL while the loop runs; and the rank opens
MLflow's store only for what else the function asks of it (call_store.py).

When the call is not tracked (FANRUN_MLFLOW=off, or the answer says so), what the function logs
through MLflow goes nowhere (tracking_off.py).

Run as a file by the worker, like the worker itself: standard library only, and mlflow is
never imported here, so a function that does not use mlflow does not pay for importing it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import socket
import sys

_contract = runpy.run_path(os.path.join(os.path.dirname(__file__), "contract.py"))
# Set in every rank of a call: OFF, or the path of the socket that tells the call's run.
VARIABLE = _contract["ENV_TRACKING"]
OFF = "off"
# Left in the run directory by a rank whose function logged to MLflow while the call was not tracked.
DROPPED_MARKER = "mlflow-dropped"
# Left by a rank on a machine that cannot see the call's store (a file on the caller's machine),
# whose function logged something other than the call's metrics, which was dropped.
UNREACHABLE_MARKER = "mlflow-store-unreachable"
# Seconds a rank's values gather before they go to the caller, unless the user set MLflow's own.
DEFAULT_BUFFER_S = 1.0
# The agent answers within its own deadline for making the run; this only guards against one
# that can no longer answer at all.
IDENTITY_WAIT_S = 300.0
# Larger than any answer the caller sends (a few variables).
MAX_ANSWER = 1 << 16


def install() -> None:
    how = os.environ.get(VARIABLE)
    if not how:
        return
    if "mlflow" in sys.modules:
        _after_import(sys.modules["mlflow"], _before_import(how))
    else:
        # The answer is awaited while mlflow imports: on a process's first call the agent is
        # still importing mlflow itself and making the run. (Importing mlflow reads none of the
        # variables the answer sets.)
        sys.meta_path.insert(0, _AroundImport("mlflow", lambda: _in_background(_before_import, how),
                                              lambda mlflow, answer: _after_import(mlflow, answer())))


def _in_background(fn, *args):
    """Runs fn(*args) in a thread of its own; returns what waits for its result."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:  # noqa: B036 - raised again in the waiting thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="fanrun-mlflow-answer", daemon=True)
    thread.start()

    def wait():
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return wait


class _AroundImport:
    """A meta path finder that runs `before()` when a module is first imported, lets the usual
    finders load it, then calls `after(module, what before returned)`."""

    def __init__(self, name: str, before, after) -> None:
        self._name = name
        self._before = before
        self._after = after

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)  # once only, and the real finders must not meet it again
        state = self._before()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, after = spec.loader.exec_module, self._after

        def exec_then_call_back(module) -> None:
            exec_module(module)
            after(module, state)

        spec.loader.exec_module = exec_then_call_back
        return spec


def _before_import(how: str) -> tuple:
    """("run", run_id, socket, the run as JSON) for the call's run, with MLflow's variables set
    for it; ("relay", run_id, socket, namespace of tracking_off.py) for that run where its store
    cannot be seen from here; ("off", namespace of tracking_off.py) when the call is not
    tracked, with the tracking URI pointed nowhere. Runs before mlflow reads its variables:
    beside its import."""
    if how != OFF:
        try:
            channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            channel.settimeout(IDENTITY_WAIT_S)
            channel.connect(how)
            answer = json.loads(channel.recv(MAX_ANSWER))
            channel.settimeout(None)
        except (OSError, ValueError) as error:
            channel.close()
            _say(f"could not learn the call's MLflow run ({type(error).__name__}: {error}); "
                 f"what this rank logs with mlflow goes nowhere")
        else:
            if answer.get("run_id"):
                os.environ.update(answer["env"])
                if not _store_in_reach(os.environ.get("MLFLOW_TRACKING_URI", "")):
                    # A rank on another machine of a cluster than the caller's local store: the run
                    # is made active in the store of nowhere, and its metrics still go to the caller.
                    return "relay", answer["run_id"], channel, _point_nowhere()
                return "run", answer["run_id"], channel, answer.get("run")
            channel.close()
    return "off", _point_nowhere()


def _point_nowhere() -> dict:
    """tracking_off.py's namespace, with MLflow's tracking URI set to its store of nowhere."""
    off = runpy.run_path(os.path.join(os.path.dirname(__file__), "tracking_off.py"))
    os.environ["MLFLOW_TRACKING_URI"] = off["URI"]
    return off


def _store_in_reach(uri: str) -> bool:
    """False for a store in a file (sqlite, or a folder of runs) that this machine does not have:
    the caller's own, seen from another machine of a cluster. Servers count as reachable."""
    from urllib.parse import urlparse

    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):].split("?", 1)[0]
    elif uri.startswith("file:"):
        path = urlparse(uri).path
    elif uri and "://" not in uri:
        path = uri
    else:
        return True
    return os.path.exists(path)


def _after_import(mlflow, state: tuple) -> None:
    if state[0] == "run":
        _, run_id, channel, snapshot = state
        _activate(mlflow, run_id, channel, snapshot=snapshot)
        return
    if state[0] == "relay":
        _, run_id, channel, off = state
        run_dir = os.environ.get(_contract["ENV_RUN_DIR"], ".")
        try:
            off["install"](off["marker"](run_dir, UNREACHABLE_MARKER), _panel_feed())
        except Exception as error:
            _say(f"could not stand in for the unreachable tracking store ({type(error).__name__}: {error})")
            return
        # The store of nowhere stands in for this rank's params and tags as for the rest it logs.
        _activate(mlflow, run_id, channel, send_params=False)
        return
    off = state[1]
    try:
        off["install"](off["marker"](os.environ.get(_contract["ENV_RUN_DIR"], "."), DROPPED_MARKER), _panel_feed())
    except Exception as error:
        _say(f"could not turn MLflow's logging off ({type(error).__name__}: {error})")
    # The runs MLflow started on its own for what the function logged, in the store of nowhere.
    _undo.append(lambda: _end_runs(mlflow))


def _say(text: str) -> None:
    print(f"fanrun: rank {os.environ.get('RANK', '?')}: {text}", file=sys.stderr, flush=True)


def _activate(mlflow, run_id: str, channel: socket.socket, send_params: bool = True, snapshot: str | None = None) -> None:
    """Makes the call's run the active one, on a store of its own (call_store.py)."""
    call_store = runpy.run_path(os.path.join(os.path.dirname(__file__), "call_store.py"))
    try:
        run = call_store["run_from_json"](snapshot)
    except Exception as error:
        _say(f"reads the call's MLflow run from the tracking store ({type(error).__name__}: {error})")
        run = None
    try:
        # Rank 0's params go under their own keys: one the resumed run holds already is not changed.
        logged = run.data.params if run is not None and not rank_suffix() else {}
        send, keyed = _sender(channel, send_params, logged)
    except Exception as error:
        # The store itself still takes them: slower, nothing lost.
        _say(f"logs its metrics straight to the tracking store ({type(error).__name__}: {error})")
        send, keyed = None, None
    try:
        store = call_store["CallStore"].install(run_id, run, send, keyed)
        _undo.append(store.uninstall)
        # Without this, the run would become active only at the first logging call, and
        # mlflow.active_run() would be None until then. The run is resumed, not created: the
        # agent made it and sets its final status once every rank has ended.
        if mlflow.active_run() is None:
            mlflow.start_run(run_id=run_id)
            # As MLflow does when it resumes a run from this variable: left set, it would make
            # every later start_run(nested=True) in the function resume the call's run instead.
            if os.environ.get("MLFLOW_RUN_ID") == run_id:
                del os.environ["MLFLOW_RUN_ID"]
                # MLflow forgets the active run in a forked child (a DataLoader worker): there the
                # variable makes its first log_metric resume the call's run, not start a new one.
                os.register_at_fork(after_in_child=lambda: _ended or os.environ.setdefault("MLFLOW_RUN_ID", run_id))
        _undo.append(lambda: _end_runs(mlflow))
        _flush_before_thread_shutdown(mlflow)
    except Exception as error:
        _say(f"could not make MLflow run {run_id} active ({type(error).__name__}: {error}); "
             f"the function's mlflow calls may fail the same way.")
        return
    if send is not None:
        _shortcut_fluent_logging(mlflow, run_id, send)


# What flush_metrics() sends: the sender and the panel's feed of this call, once its function
# has imported mlflow.
_pending_flushes: list = []
# What end_call() undoes, last first.
_undo: list = []
_ended = False  # end_call() has run: what this call registered in the process does nothing more


def end_call() -> None:
    """For a rank that stays for another call (_rank/keep.py): what the process's exit would do
    for this call's run, done now, and MLflow given back as this call found it. The runs the
    function left active end, the call's run with its status left to the agent; its last
    metrics are sent and its socket is closed; MLflow's store and logging functions are
    MLflow's own again."""
    global _ended
    flush_metrics()
    for undo in reversed(_undo):
        try:
            undo()
        except Exception as error:
            _say(f"could not end this call's MLflow run in the process ({type(error).__name__}: {error})")
    _undo.clear()
    _pending_flushes.clear()
    _ended = True


def flush_metrics() -> None:
    """Sends the metrics still gathering, at once, before the rank reports its result or its
    failure: a failing rank's engine then stops every rank, and what it logged up to its failure
    is what shows why; the panel shows the last points of either."""
    for flush in _pending_flushes:
        try:
            flush()
        except OSError:
            pass  # the caller is gone: the run is over


def _sender(channel: socket.socket, send_params: bool, logged: dict[str, str]) -> tuple:
    """What sends this rank's metrics of the call's run to the caller, and (with send_params)
    its params and tags (a _KeyedValues; `logged`: the params the run holds): (send, keyed)."""
    sender_class = runpy.run_path(os.path.join(os.path.dirname(__file__), "metric_sender.py"))["MetricSender"]
    buffer_s = float(os.environ.get("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS") or DEFAULT_BUFFER_S)
    sender = sender_class(channel, buffer_s)
    _before_thread_shutdown(sender.close)
    _undo.append(sender.close)
    _pending_flushes.append(sender.flush)

    from mlflow.utils.validation import _validate_metric

    feed = _panel_feed()
    suffix = rank_suffix()

    def send(records: list[tuple]) -> None:
        """records: (key, value, timestamp, step, model_id, dataset_name, dataset_digest)."""
        on_run = [(on_the_run(key, suffix), *rest) for key, *rest in records] if suffix else records
        for key, value, timestamp, step, *_ in on_run:
            # Checked here, as the store would: a bad name or value raises in the rank's own call.
            _validate_metric(key, value, timestamp, step)
        sender.add(on_run)
        if feed is not None:
            feed(records)  # the panel plots each rank's own series, under the names it logged

    return send, _KeyedValues(sender.add, logged) if send_params else None


def rank_suffix() -> str:
    """What this rank's metrics are renamed with on the call's run: rank 0 logs under the names
    the function gives, rank N under `name/rank_N`, so that every key holds one series, one value
    per step, and the UI shows each rank's beside rank 0's. (Rank 0 is the one every training
    script already treats as the run's voice.)"""
    rank = os.environ.get("RANK", "0")
    return "" if rank in ("", "0") else f"/rank_{rank}"


def on_the_run(key: str, suffix: str) -> str:
    """A metric's name on the call's run; one that names its rank already (fanrun.data's
    `data/wait_seconds/rank_N`, a user's own `loss/rank_N`) is kept as it is."""
    return key if key.endswith(suffix) else key + suffix


def _panel_feed():
    """panel_feed.py's feed for this rank, or None where the caller's panel plots nothing."""
    feed = runpy.run_path(os.path.join(os.path.dirname(__file__), "panel_feed.py"))["make_feed"]()
    if feed is not None:
        _pending_flushes.append(feed.flush)
    return feed


class _KeyedValues:
    """A rank's params and tags on the call's run, sent to the agent as ("param" | "tag", rank,
    key, value) records; MLflow's own tags (mlflow.*, which MLflow sets itself) still go to the
    store. A param this rank changes is refused, as MLflow's store would refuse it."""

    def __init__(self, send_keyed, logged: dict[str, str]) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.utils.validation import _validate_param, _validate_tag

        self._send, self._exception = send_keyed, MlflowException
        self._validate_param, self._validate_tag = _validate_param, _validate_tag
        self._rank = int(os.environ.get("RANK", "0"))
        self._params: dict[str, str] = dict(logged)

    def send(self, params, tags) -> tuple[list, list]:
        records, kept_tags = [], []
        for param in params or ():
            self._validate_param(param.key, param.value)
            value = str(param.value)
            before = self._params.setdefault(param.key, value)
            if before != value:
                raise self._exception(
                    f"Changing param values is not allowed. Param with key='{param.key}' was already logged with "
                    f"value='{before}' by rank {self._rank}. Attempted logging new value '{value}'.",
                    "INVALID_PARAMETER_VALUE")
            records.append(("param", self._rank, param.key, value))
        for tag in tags or ():
            if tag.key.startswith("mlflow."):
                kept_tags.append(tag)
                continue
            self._validate_tag(tag.key, tag.value)
            records.append(("tag", self._rank, tag.key, str(tag.value)))
        if records:
            self._send(records)
        return [], kept_tags


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

    def undo() -> None:
        mlflow.log_metric, mlflow.log_metrics = mlflow_log_metric, mlflow_log_metrics

    _undo.append(undo)


def _end_runs(mlflow) -> None:
    """What MLflow's exit handler does: every run still active ends (FINISHED), the call's run
    with its status left to the agent (call_store.py). Then the experiment and tracking URI that
    the function set are forgotten, as a new process would not know them: the next call's run
    is in its own experiment, and its store is the one its variables name."""
    while mlflow.active_run() is not None:
        mlflow.end_run()
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils

    fluent._active_experiment_id = None
    utils._tracking_uri = None


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
        register(lambda: _ended or fn(*args))


def _flush(mlflow) -> None:
    try:
        mlflow.flush_async_logging()
    except Exception as error:
        print(f"fanrun: MLflow could not send this rank's last metrics ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
