"""The MLflow run of one .distributed() call: created while the ranks start, learned by every
rank whose function imports mlflow, ended with the call's outcome; parameters, rank logs and
system metrics logged on it.

This is the caller's half. The MLflow work itself is done by the process's tracking agent
(agent_connection.py, agent.py), so that importing mlflow and opening the store
happen once per process, beside the caller's own work and the ranks' start, and the caller's
process never imports mlflow. The ranks learn the run through a socket the caller makes before
they start and hands to the agent, and only when their function imports mlflow
(_rank/tracking.py): a function that never does never waits for the run.

A call waits for the agent twice only. A run_id= to resume is checked before any rank starts (a
mistake there must stop the call). And once its ranks have ended, the call waits until the agent
has closed its run: when .distributed() returns or raises, the run's status, its parameters and
every metric the ranks logged are in the store, whatever the store, and a reader of the run right
after the call sees its final state. While the ranks run, the call never waits for MLflow: the run
is made beside them and its line shown as soon as it exists. The wait is bounded
(CLOSE_DEADLINE_S); a close that overruns it goes on in the background, with a warning, and
flush_tracking() and the caller's exit wait for it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import numbers
import os
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from . import agent_connection
from .._rank import tracking as rank_half
from . import store as tracking_store
from .._accelerators import Plan
from .agent_channel import AGENT_START_S, CLOSE_DEADLINE_S, FINISH_DEADLINE_S, START_DEADLINE_S
from .._errors import RunNotFoundError, RunTimeoutError, TrackingWarning
from ..backends.metric_relay import RelaySocket
from .._spec.paths import RunPaths
from .links import TrackedRun, announce, in_jupyter_kernel

# MLflow refuses longer tag values (5000 characters on some stores).
MAX_TAG_CHARS = 4000
# How long the caller's exit waits for an idle agent to end once its channel is closed.
AGENT_EXIT_WAIT_S = 5.0
_OFF_VALUES = {"0", "false", "no", "off"}
_notice_lock = threading.Lock()
_notices_shown: set[str] = set()


def enabled(tracking: bool) -> bool:
    """tracking=True unless FANRUN_TRACKING=0 turns tracking off for the whole process."""
    return tracking and os.environ.get("FANRUN_TRACKING", "1").strip().lower() not in _OFF_VALUES


def tracking_by_default() -> bool:
    """Whether a call that does not say otherwise is tracked: MLflow is installed, and
    FANRUN_TRACKING does not turn tracking off."""
    return enabled(True) and _mlflow_installed()


def start_agent_early(options: Any) -> None:
    """In a Jupyter kernel, the agent starts when a tracked function is defined: the first call
    then finds mlflow imported. A script starts it with its first call, as it may make none."""
    if options.leave_mlflow_alone or not enabled(options.tracking) or not in_jupyter_kernel() or not _mlflow_installed():
        return
    try:
        agent_connection.connection()
    except OSError:
        pass  # the first call tries again, and says why it could not


@dataclasses.dataclass
class TrackedCall:
    """What the ranks need from tracking, and the run's directory, which the call path makes
    once tracking has let the call go on (a run_id= that names no run stops it first)."""

    rank_env: dict[str, str]
    paths: RunPaths | None = None
    # What the run logs as it ends, where it is the call's run: the call's goodput ledger (hook.holds_ledger).
    final_metrics: Callable[[], dict[str, float]] | None = None
    # Parameters known only once the ranks have started, which the run logs as it ends: the health
    # gate's verdicts that a cluster's nodes gave (hook.node_health).
    final_params: dict[str, str] = dataclasses.field(default_factory=dict)
    _run: _CallRun | None = dataclasses.field(default=None, repr=False)

    def use_directory(self, paths: RunPaths) -> None:
        """The attempt's directory, once made: the ranks' logs are uploaded from it at the end,
        and while the call runs the agent reads the ranks' step times there (rank_steps.py)."""
        self.paths = paths
        if self._run is not None:
            self._run.directory_made(paths)


@contextlib.contextmanager
def track_submission(*, function_name: str, plan: Plan, options: Any) -> Iterator[Submission | None]:
    """A call that may restart (max_restarts > 0) gets one MLflow run for the whole call, the
    parent of each attempt's run (track(submission=)), as a retried job's runs are nested under
    it on Databricks; its status is the call's, and `fanrun.attempts` says how many it took.
    Yields None where there is no such run: no restarts, a run_id= resumed by every attempt, or
    no tracking (each attempt's own run says why)."""
    if (options.max_restarts == 0 or options.run_id is not None or options.leave_mlflow_alone
            or not enabled(options.tracking) or not _mlflow_installed()):
        yield None
        return
    show_warnings()
    run = _CallRun(function_name, plan, options, [], role="submission")
    try:
        run.start()
    except OSError:
        yield None  # the first attempt tries again, and warns
        return
    submission = Submission(run)
    try:
        yield submission
    except BaseException as error:
        run.end(None, 0, error, {"fanrun.attempts": str(submission.attempts)}, _final_metrics(submission))
        raise
    run.end(None, 0, None, {"fanrun.attempts": str(submission.attempts)}, _final_metrics(submission))


@dataclasses.dataclass
class Submission:
    """The run of a call that may restart, and how many attempts it has started."""

    run: _CallRun
    attempts: int = 0
    final_metrics: Callable[[], dict[str, float]] | None = None  # as TrackedCall's


@contextlib.contextmanager
def track(*, function_name: str, plan: Plan, gpu_indices: list[int], options: Any,
          submission: Submission | None = None,
          health: tuple[dict[str, str], dict[str, float]] = ({}, {})) -> Iterator[TrackedCall]:
    """Starts the call's MLflow run (or not), yields what the ranks need, and hands the agent the
    call's outcome: FINISHED, KILLED (interrupt, timeout) or FAILED (anything else). Under a
    `submission`, the run is its next attempt's, nested under the submission's run."""
    if submission is not None:
        submission.attempts += 1
    if options.leave_mlflow_alone:
        yield TrackedCall({})
        return
    untracked = TrackedCall({rank_half.VARIABLE: rank_half.OFF})
    if not enabled(options.tracking):
        try:
            yield untracked
        finally:
            _tell_if_marked(untracked.paths, rank_half.DROPPED_MARKER)
        return
    if not _mlflow_installed():
        _notice_once(
            "missing",
            "fanrun: MLflow is not installed, so this call is not tracked "
            "(pip install mlflow to track it; tracking=False hides this notice).",
        )
        yield untracked
        return
    show_warnings()  # what the agent had to say about earlier calls' runs
    run = _CallRun(function_name, plan, options, gpu_indices, submission=submission)
    run.add_health(*health)
    try:
        run.start()
    except OSError as error:  # UnsafePathError included
        _warn(f"fanrun: MLflow tracking is off for this call of {function_name!r}: {error}. The function still "
              f"runs on every rank; what it logs with mlflow is dropped.")
        yield untracked
        return
    call = TrackedCall(run.rank_environment(), _run=run)
    try:
        if options.run_id is not None:
            run.wait_opened()  # a run_id that names no run raises here, before any rank starts
        yield call
    except BaseException as error:
        run.end(call.paths, plan.world_size, error, metrics=_final_metrics(call), params=call.final_params)
        raise
    finally:
        _tell_if_marked(call.paths, rank_half.UNREACHABLE_MARKER)
    run.end(call.paths, plan.world_size, None, metrics=_final_metrics(call), params=call.final_params)


def _final_metrics(run: TrackedCall | Submission) -> dict[str, float]:
    """What the call's run logs as it ends; a failure to reckon it never hides the call's outcome."""
    if run.final_metrics is None:
        return {}
    try:
        return run.final_metrics()
    except Exception as error:
        _warn(f"fanrun: the call's goodput ledger could not be logged to its MLflow run: {type(error).__name__}: {error}")
        return {}


class _CallRun:
    """The caller's end of one call's run: it decides where the run goes, hands the call to the
    agent, announces the run (or warns) when the agent answers, and sends the call's outcome."""

    def __init__(self, function_name: str, plan: Plan, options: Any, gpu_indices: list[int], *,
                 role: str = "call", submission: Submission | None = None) -> None:
        self.function_name = function_name
        self.world_size = plan.world_size
        # An attempt's run is nested under its submission's, which alone is shown to the user;
        # what goes wrong with tracking is said by each attempt, which alone can drop metrics.
        self._announces = submission is None
        self._warns = role != "submission"
        self.run: TrackedRun | None = None
        # Where this call's warnings point: the user's line, from whichever thread they are shown.
        self.warning_at = _user_frame()
        self._raised: Warning | None = None  # a TrackingWarning the user's filters made an error
        self._not_found: str | None = None
        self._answered = threading.Event()
        self._lock = threading.Lock()
        self._ended = False
        # What only this thread can see: MLflow keeps the active run per thread.
        mlflow = sys.modules.get("mlflow")
        active = mlflow.active_run() if mlflow is not None else None
        parent_id = active.info.run_id if active is not None else (os.environ.get("MLFLOW_RUN_ID") or None)
        run_name = getattr(options, "run_name", None) or f"{function_name}-{secrets.token_hex(3)}"
        params = _parameters(function_name, plan, options)
        if role == "submission":
            params["fanrun.max_restarts"] = str(options.max_restarts)
            params["fanrun.restart"] = options.restart
        if submission is not None:
            parent = submission.run._call
            run_name, parent_id = f"{parent['run_name']}-attempt-{submission.attempts}", None
            params["fanrun.attempt"] = str(submission.attempts)
        self._call = {
            "role": role,
            # The agent's id of the submission whose run this one's is nested under.
            "parent_call": submission.run._id if submission is not None else None,
            "function_name": function_name,
            "run_name": run_name,
            "params": params,
            "experiment_name": options.experiment_name,
            "run_id": options.run_id,
            "parent_id": parent_id,
            "started_ms": int(time.time() * 1000),
            "gpu_indices": gpu_indices,
            "argv0": sys.argv[0] if sys.argv and sys.argv[0] else "",
            "store_dir": None,
        }
        self._in_fanrun_store = _in_fanrun_store(mlflow, active)

    def add_health(self, params: dict[str, str], metrics: dict[str, float]) -> None:
        """The GPU health gate's verdicts (parameters) and deep figures (metrics, at step 0)."""
        self._call["params"].update(params)
        self._call["metrics"] = dict(metrics)

    def start(self) -> None:
        if self._in_fanrun_store:
            store = tracking_store.default_store()
            self._call["store_dir"] = str(store.directory)
            # MLflow's own variable, so that the agent, the ranks, the processes this one starts
            # and its own later mlflow calls (mlflow.search_runs) all find the same runs.
            os.environ["MLFLOW_TRACKING_URI"] = store.uri
        self.socket = RelaySocket()
        try:
            self._agent = agent_connection.connection()
            self._id = self._agent.open_call(self._call, self.socket.listener.fileno(), self)
        except BaseException:
            self.socket.close()
            raise
        self.socket.listener.close()  # the agent serves its copy; the caller keeps only the folder

    def rank_environment(self) -> dict[str, str]:
        env = {
            rank_half.VARIABLE: self.socket.path,
            # The agent samples the machine once for the run; a monitor in every rank would
            # write the same metric names N times over.
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        }
        # Each rank ends its MLflow session at exit, and MLflow would print the run's link from
        # every one of them; the caller has shown it once already. The user's to override.
        if "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ:
            env["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        return env

    def directory_made(self, paths: RunPaths) -> None:
        self._agent.call_directory(self._id, str(paths.directory), self.world_size)

    def wait_opened(self) -> None:
        """Before any rank starts: the run to resume exists, or the call stops here."""
        if not self._answered.wait(AGENT_START_S + START_DEADLINE_S):
            self._warn_off(f"no answer from the process that tracks it within {AGENT_START_S + START_DEADLINE_S:g} s")
        if self._not_found is not None:
            raise RunNotFoundError(self._not_found)  # the agent has ended the call already

    def answered(self, kind: str, body: dict) -> None:
        """The agent's answer, in the connection's reader thread: the run's line (or link) appears
        as soon as the run exists, during the call or just after it."""
        with self._lock:
            if kind == "opened":
                self.run = TrackedRun(client=None, first_system_step=0, **{k: v for k, v in body.items() if k != "id"})
                if self._announces:
                    announce(self.run)  # after a quick call's end too: its run exists from now on
            elif kind == "not_found":
                self._not_found = body["message"]
            else:
                self._warn_off(body["problem"])
            self._answered.set()

    def end(self, paths: RunPaths | None, world_size: int, error: BaseException | None,
            extra_tags: dict[str, str] | None = None, metrics: dict[str, float] | None = None,
            params: dict[str, str] | None = None) -> None:
        """Hands the agent the outcome and waits until it has closed the run: made it if it had
        not yet, written what the ranks sent, set the status. What it had to say about the run is
        shown here, at the user's line, before the call returns or raises."""
        status, tags = outcome(error)
        tags.update(extra_tags or {})
        self._agent.finish_call(self._id, {
            "status": status, "tags": tags, "world_size": world_size,
            "run_dir": str(paths.directory) if paths is not None else None, "metrics": metrics or {},
            "params": params or {},
        })
        # Every rank has ended: none will connect to the socket again.
        self.socket.close()
        try:
            # Bounded by the agent's own deadlines, and its start if the call outran it.
            closed = self._agent.wait_call_closed(self._id, AGENT_START_S + CLOSE_DEADLINE_S)
            if not closed:
                name = f"{self.run.run_name} ({self.run.run_id})" if self.run is not None else f"of this call of {self.function_name!r}"
                self._warn(f"fanrun: the MLflow run {name} is still being closed after "
                           f"{AGENT_START_S + CLOSE_DEADLINE_S:g} s; it is closed in the background, and "
                           f"fanrun.flush_tracking() waits for it.")
        finally:
            with self._lock:
                self._ended = True
        # A warning raised as an error must not hide the call's own error.
        show_warnings(raise_errors=error is None)
        if self._raised is not None and error is None:
            raise self._raised

    def _warn_off(self, problem: str) -> None:
        self._warn(f"fanrun: MLflow tracking is off for this call of {self.function_name!r}: {problem}. The function "
                   f"still runs on every rank; what it logs with mlflow is dropped. Check the tracking server, "
                   f"or pass tracking=False to @distributed to run without it.")

    def _warn(self, message: str) -> None:
        """At the user's line that made the call, from whichever thread; where the user's filters
        turn it into an error, the call raises it at its end."""
        if not self._warns:
            return
        if self._ended:
            # The call has returned or raised: shown at the next call, or at exit.
            agent_connection.add_warning(message, self.warning_at)
            return
        try:
            warnings.warn_explicit(message, TrackingWarning, *self.warning_at)
        except Warning as raised:
            self._raised = raised


def flush_tracking(timeout: float | None = 60.0) -> None:
    """Waits until the MLflow run of every call this process has made is closed.

    A call returns or raises once its run is closed, with its final metrics, the ranks' logs and
    its status; only a close that overran the call's own bound (a stalled store) goes on in the
    background, and this waits for it. A call still running in another thread is not waited for.
    Raises TimeoutError if a run is still being closed after `timeout` seconds (None: no limit)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0):
        raise ValueError(f"timeout must be a number of seconds (0 or more) or None, not {timeout!r}")
    agent = agent_connection.current()
    left = agent.wait_closed(timeout) if agent is not None else 0
    show_warnings()
    if left:
        raise TimeoutError(f"fanrun: {left} MLflow run(s) still being closed after {timeout:g} s; they are closed "
                           f"in the background, or at the latest when this process exits")


def show_warnings(raise_errors: bool = True) -> None:
    """The warnings of calls' runs not shown yet, each at the user's line that made the call.
    One that the user's filters make an error is raised, or, with raise_errors=False (the call is
    raising its own error), written to stderr."""
    pending = agent_connection.take_warnings()
    for index, (message, where) in enumerate(pending):
        try:
            warnings.warn_explicit(message, TrackingWarning, *where)
        except Warning as raised:
            if raise_errors:
                agent_connection.give_back_warnings(pending[index + 1 :])
                raise
            print(f"{type(raised).__name__}: {raised}", file=sys.stderr, flush=True)


def _at_exit() -> None:
    """A script's runs are closed when it ends: its exit waits for the agent, within a bound."""
    agent = agent_connection.current()
    if agent is None:
        return
    left = agent.wait_closed(FINISH_DEADLINE_S)
    if left:
        print(f"fanrun: {left} MLflow run(s) still being closed after {FINISH_DEADLINE_S:g} s at exit; the process "
              f"that tracks them finishes them alone.", file=sys.stderr, flush=True)
    try:
        show_warnings()
    except Warning as raised:  # filters that make warnings errors: nobody is left to catch it
        print(f"{type(raised).__name__}: {raised}", file=sys.stderr, flush=True)
    agent_connection.shutdown(0 if left else AGENT_EXIT_WAIT_S)


atexit.register(_at_exit)


def _mlflow_installed() -> bool:
    if "mlflow" in sys.modules:
        return sys.modules["mlflow"] is not None  # None: an import of it is refused
    return importlib.util.find_spec("mlflow") is not None


def _in_fanrun_store(mlflow, active) -> bool:
    """Whether the run goes to fanrun's own store: the tracking URI names it (an earlier call set
    it), or nothing chooses where runs go: no tracking URI (MLFLOW_TRACKING_URI, which
    mlflow.set_tracking_uri also sets), not on Databricks, and no run or experiment of MLflow's
    own default store in use (mlflow.set_experiment sets MLFLOW_EXPERIMENT_ID)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return tracking_store.is_default_store(uri)
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return False
    if os.environ.get("MLFLOW_RUN_ID") or os.environ.get("MLFLOW_EXPERIMENT_ID") or active is not None:
        return False
    service = sys.modules.get("mlflow.tracking._tracking_service.utils")
    return mlflow is None or not getattr(service, "_tracking_uri", None)


def _parameters(function_name: str, plan: Plan, options: Any) -> dict[str, str]:
    from .._version import __version__

    return {
        "fanrun.function": function_name,
        "fanrun.world_size": str(plan.world_size),
        "fanrun.num_accelerators": str(plan.world_size),
        "fanrun.accelerator_type": plan.accelerator_type,
        "fanrun.accelerators": plan.description,
        "fanrun.timeout_s": "none" if options.timeout is None else f"{options.timeout:g}",
        "fanrun.version": __version__,
    }


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


# ---------------------------------------------------------------- notices and warnings


# What a rank's marker in the run directory (_rank/tracking.py) makes the caller say, once per process.
_MARKER_NOTICES = {
    # The call was not tracked, and what its ranks logged with mlflow went nowhere.
    rank_half.DROPPED_MARKER: (
        "fanrun: this call is not tracked (tracking=False or FANRUN_TRACKING=0), so what its ranks logged "
        "with mlflow went nowhere; no MLflow run was made. Leave tracking on to keep it."
    ),
    # Ranks on other machines of a cluster could not see the call's store (a file on this machine).
    rank_half.UNREACHABLE_MARKER: (
        "fanrun: ranks on other machines cannot see this call's MLflow store (a file on this machine): their "
        "metrics reached the run through fanrun, but the parameters, tags and artifacts they logged were "
        "dropped. Use a tracking server (MLFLOW_TRACKING_URI=http://...) to keep them."
    ),
}


def _tell_if_marked(paths: RunPaths | None, marker: str) -> None:
    if paths is not None and (paths.directory / marker).exists():
        _notice_once(marker, _MARKER_NOTICES[marker])


def _notice_once(key: str, text: str) -> None:
    with _notice_lock:
        if key in _notices_shown:
            return
        _notices_shown.add(key)
    print(text, file=sys.stderr, flush=True)


def _user_frame() -> tuple:
    """(filename, lineno, module, registry) of the user's line that called .distributed(), the first
    frame outside fanrun: what warnings.warn_explicit needs to warn there from any thread. (Not the
    module's globals: a `python -c` program's loader cannot give its source, and linecache finds
    files and notebook cells by name.)"""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(0)
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__"), registry


def _warn(message: str) -> None:
    """Warns at the user's line that called .distributed(), not at fanrun's own frames."""
    warnings.warn_explicit(message, TrackingWarning, *_user_frame())
