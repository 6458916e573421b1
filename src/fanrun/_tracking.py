"""The MLflow run of one .distributed() call: created while the ranks start, learned by every
rank whose function imports mlflow, ended with the call's outcome; parameters, rank logs and
system metrics logged on it.

This is the caller's half. The MLflow work itself is done by a process of its own, started with
the call (_tracking_agent.py says why), so that importing mlflow and opening the store happen
beside the caller's own work and the ranks' start, not before them, and the caller's process
never imports mlflow. The ranks learn the run through a socket the caller makes before they
start, and only when their function imports mlflow (_rank_tracking.py): a function that never
does never waits for the run. A run_id= to resume is checked before any rank starts, as a
mistake there must stop the call.

The caller and the agent exchange one JSON message at a time over a socket pair:
  caller -> agent  {"call": {...}}                the call to track, at once
  agent -> caller  {"opened": {run}} | {"off": problem} | {"not_found": message}
  caller -> agent  {"finish": {status, tags, run_dir, world_size}}   when the ranks have ended
  agent -> caller  {"closed": {"warnings": [...]}}                      then the agent exits
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from typing import Any

from . import _rank_tracking as rank_half
from . import _tracking_store
from ._accelerators import Plan
from ._errors import RunTimeoutError
from ._metric_relay import RelaySocket
from ._launch.paths import RunPaths

# Bounds on the agent's MLflow calls: a stalled server costs this much, never a hang.
START_DEADLINE_S = 20.0
FINISH_DEADLINE_S = 60.0
# On top of those: the agent's own start (an interpreter, fanrun and mlflow imported) on a busy machine.
AGENT_START_S = 60.0
# MLflow refuses longer tag values (5000 characters on some stores).
MAX_TAG_CHARS = 4000
# Larger than any message between the caller and the agent (a call's description, an outcome).
MAX_MESSAGE = 1 << 20
_OFF_VALUES = {"0", "false", "no", "off"}
_notice_lock = threading.Lock()
_notices_shown: set[str] = set()


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
    client: Any  # the agent's MlflowClient; None in the caller
    run_id: str
    run_name: str
    experiment_id: str
    experiment_name: str
    tracking_uri: str
    first_system_step: int
    registry_uri: str = ""
    # A `fanrun ui` server showing this run's local store, when one answered at the start.
    ui_url: str | None = None


def enabled(tracking: bool) -> bool:
    """tracking=True unless FANRUN_TRACKING=0 turns tracking off for the whole process."""
    return tracking and os.environ.get("FANRUN_TRACKING", "1").strip().lower() not in _OFF_VALUES


@contextlib.contextmanager
def track(*, function_name: str, plan: Plan, gpu_indices: list[int], options: Any) -> Iterator[TrackedCall]:
    """Starts the call's MLflow run (or not), yields what the ranks need, and ends the run with
    the call's outcome: FINISHED, KILLED (interrupt, timeout) or FAILED (anything else)."""
    if options.leave_mlflow_alone:
        yield TrackedCall()
        return
    call = TrackedCall(rank_env={rank_half.VARIABLE: rank_half.OFF})
    if not enabled(options.tracking):
        try:
            yield call
        finally:
            _tell_if_dropped(call.paths)
        return
    if not _mlflow_installed():
        _notice_once(
            "missing",
            "fanrun: MLflow is not installed, so this call is not tracked "
            "(pip install mlflow to track it; tracking=False hides this notice).",
        )
        yield call
        return
    run = _AgentRun(function_name, plan, options, gpu_indices)
    try:
        run.start()
    except OSError as error:  # UnsafePathError included
        _warn(f"fanrun: MLflow tracking is off for this call of {function_name!r}: {error}. The function still "
              f"runs on every rank; what it logs with mlflow is dropped.")
        yield call
        return
    if options.run_id is not None:
        run.wait_opened()  # a run_id that names no run raises here, before any rank starts
    call.rank_env = run.rank_environment()
    try:
        yield call
    except BaseException as error:
        run.finish(call.paths, plan.world_size, error)
        raise
    run.finish(call.paths, plan.world_size, None)


class _AgentRun:
    """The caller's end of one call's run: it decides where the run goes, starts the agent,
    announces the run (or warns) when the agent answers, and sends the call's outcome."""

    def __init__(self, function_name: str, plan: Plan, options: Any, gpu_indices: list[int]) -> None:
        self.function_name = function_name
        self.run: _Run | None = None
        self._warning_at = _user_frame()
        self._raised: Warning | None = None  # a TrackingWarning the user's filters made an error
        self._not_found: str | None = None
        # What only this thread can see: MLflow keeps the active run per thread.
        mlflow = sys.modules.get("mlflow")
        active = mlflow.active_run() if mlflow is not None else None
        parent_id = active.info.run_id if active is not None else (os.environ.get("MLFLOW_RUN_ID") or None)
        self._call = {
            "function_name": function_name,
            "run_name": f"{function_name}-{secrets.token_hex(3)}",
            "params": _parameters(function_name, plan, options),
            "experiment_name": options.experiment_name,
            "run_id": options.run_id,
            "parent_id": parent_id,
            "started_ms": int(time.time() * 1000),
            "gpu_indices": gpu_indices,
            "argv0": sys.argv[0] if sys.argv and sys.argv[0] else "",
            "store_dir": None,
        }
        self._in_fanrun_store = _in_fanrun_store(mlflow, active)

    def start(self) -> None:
        if self._in_fanrun_store:
            store = _tracking_store.default_store()
            self._call["store_dir"] = str(store.directory)
            # MLflow's own variable, so that the agent, the ranks, the processes this one starts
            # and its own later mlflow calls (mlflow.search_runs) all find the same runs.
            os.environ["MLFLOW_TRACKING_URI"] = store.uri
        self.socket = RelaySocket()
        try:
            self._control, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with agent_end:
                log = os.open(self.agent_log, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    self._agent = subprocess.Popen(
                        [sys.executable, "-c", _agent_code(), str(agent_end.fileno()), str(self.socket.listener.fileno())],
                        pass_fds=(agent_end.fileno(), self.socket.listener.fileno()),
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                        # Out of the terminal's process group: Ctrl+C stops the call, and the
                        # agent then closes the run as KILLED.
                        start_new_session=True,
                    )
                finally:
                    os.close(log)
            send(self._control, {"call": self._call})
        except BaseException:
            self.socket.close()
            raise
        self.socket.listener.close()  # the agent serves it; the caller keeps only the folder
        self._listener = threading.Thread(target=self._hear_opened, name="fanrun-mlflow", daemon=True)
        self._listener.start()

    @property
    def agent_log(self) -> str:
        return os.path.join(self.socket.folder, "agent.log")

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

    def wait_opened(self) -> None:
        try:
            self._listener.join()
            if self._not_found is not None:
                raise ValueError(self._not_found)
        except BaseException:
            self._end_agent()
            self.socket.close()
            raise

    def _hear_opened(self) -> None:
        """The agent's first answer, in a thread of the caller: the run's line (or link) appears
        as soon as the run exists, while the ranks run."""
        try:
            self._control.settimeout(AGENT_START_S + START_DEADLINE_S)
            answer = receive(self._control)
        except (OSError, ValueError) as error:
            answer = {"off": f"no answer from the process that tracks it ({describe(error)})"}
        if answer is None:
            answer = {"off": f"the process that tracks it ended early{self._agent_log_tail()}"}
        if "opened" in answer:
            self.run = _Run(client=None, first_system_step=0, **answer["opened"])
            _announce(self.run)
        elif "not_found" in answer:
            self._not_found = answer["not_found"]
        else:
            self._warn(
                f"fanrun: MLflow tracking is off for this call of {self.function_name!r}: {answer['off']}. The function "
                f"still runs on every rank; what it logs with mlflow is dropped. Check the tracking server, "
                f"or pass tracking=False to @distributed to run without it."
            )

    def finish(self, paths: RunPaths | None, world_size: int, error: BaseException | None) -> None:
        status, tags = outcome(error)
        closed = None
        try:
            send(self._control, {"finish": {
                "status": status, "tags": tags, "world_size": world_size,
                "run_dir": str(paths.directory) if paths is not None else None,
            }})
            self._listener.join()
            self._control.settimeout(AGENT_START_S + START_DEADLINE_S + 2 * FINISH_DEADLINE_S)
            closed = receive(self._control)
        except (OSError, ValueError):
            pass
        finally:
            self._end_agent()
        if self.run is not None:
            if closed is None:
                _warn(f"fanrun: the MLflow run {self.run.run_name} ({self.run.run_id}) may not be closed as {status}: the "
                      f"process that tracks it did not finish{self._agent_log_tail()}; the call's outcome is unchanged.")
            else:
                for message in closed["closed"]["warnings"]:
                    _warn(message)
        self.socket.close()
        if self._raised is not None and error is None:
            raise self._raised

    def _end_agent(self) -> None:
        """The agent exits once it has answered; one that does not (stuck in a store) is killed."""
        self._control.close()
        try:
            self._agent.wait(FINISH_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self._agent.kill()
            self._agent.wait()

    def _agent_log_tail(self) -> str:
        try:
            with open(self.agent_log, errors="replace") as log:
                lines = log.read().strip().splitlines()[-15:]
        except OSError:
            return ""
        return (":\n" + "\n".join("    " + line for line in lines)) if lines else ""

    def _warn(self, message: str) -> None:
        """At the user's line that called .distributed(), from whichever thread; where the user's
        filters turn it into an error, the call raises it at its end."""
        try:
            warnings.warn_explicit(message, TrackingWarning, *self._warning_at)
        except Warning as raised:
            self._raised = raised


def _agent_code() -> str:
    """The agent's -c program: with the caller's sys.path, as a rank has it, so that it imports the
    same fanrun and mlflow as the caller."""
    return f"import sys; sys.path[:] = {sys.path!r}; from fanrun._tracking_agent import main; main()"


def send(channel: socket.socket, message: dict) -> None:
    """One message to the agent, or from it: a JSON object in one packet."""
    channel.send(json.dumps(message).encode())


def receive(channel: socket.socket) -> dict | None:
    """The next message, or None once the other end has closed."""
    data = channel.recv(MAX_MESSAGE)
    return json.loads(data) if data else None


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
        return _tracking_store.is_default_store(uri)
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return False
    if os.environ.get("MLFLOW_RUN_ID") or os.environ.get("MLFLOW_EXPERIMENT_ID") or active is not None:
        return False
    service = sys.modules.get("mlflow.tracking._tracking_service.utils")
    return mlflow is None or not getattr(service, "_tracking_uri", None)


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


# ---------------------------------------------------------------- where the run is shown


def run_url(run: _Run) -> str | None:
    """The run's page in a UI: the tracking server's own (it serves at the tracking URI), or a
    `fanrun ui` server showing the local store."""
    if run.tracking_uri.startswith(("http://", "https://")):
        base = masked(run.tracking_uri)
    elif run.ui_url is not None:
        base = run.ui_url
    else:
        return None
    return f"{base.rstrip('/')}/#/experiments/{run.experiment_id}/runs/{run.run_id}"


def link_text(run: _Run) -> str:
    where = run_url(run)
    if where is None:
        uri = masked(run.tracking_uri)
        if _tracking_store.is_default_store(run.tracking_uri):
            where = "run `fanrun ui` to open it"
        elif _tracking_store.is_local(run.tracking_uri):
            where = f"run `fanrun ui --backend-store-uri {uri}` to open it"
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
    # One write: the line comes from a thread while rank output is being written.
    sys.stdout.write(link_text(run) + "\n")
    sys.stdout.flush()


def _in_jupyter_kernel() -> bool:
    # Only where IPython is already loaded: a plain script never pays for importing it.
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


# ---------------------------------------------------------------- notices and warnings


def _tell_if_dropped(paths: RunPaths | None) -> None:
    """Once per process: a call was not tracked, and what its ranks logged with mlflow went nowhere."""
    if paths is not None and (paths.directory / rank_half.DROPPED_MARKER).exists():
        _notice_once(
            "dropped",
            "fanrun: this call is not tracked (tracking=False or FANRUN_TRACKING=0), so what its ranks logged "
            "with mlflow went nowhere; no MLflow run was made. Leave tracking on to keep it.",
        )


def _notice_once(key: str, text: str) -> None:
    with _notice_lock:
        if key in _notices_shown:
            return
        _notices_shown.add(key)
    print(text, file=sys.stderr, flush=True)


def describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


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
