"""`fanrun ui`: MLflow's UI for fanrun's store (or another local store), served on 127.0.0.1 in
the foreground until Ctrl+C. While it runs, the line each tracked call prints links to its run
there: the server's address is recorded in a private file the calls read (store.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from . import store as tracking_store
from .._errors import UnsafePathError

# MLflow's own default port, when it is free.
DEFAULT_PORT = 5000
# An MLflow server takes seconds to start (more on a busy machine); this long is a failure.
START_DEADLINE_S = 120.0
# From SIGTERM to SIGKILL for the server's processes.
STOP_GRACE_S = 10.0
LOOPBACK = "127.0.0.1"


def main(backend_store_uri: str | None, port: int | None) -> int:
    try:
        if backend_store_uri is None:
            store = tracking_store.default_store()
            store.create()
            uri, artifacts = store.uri, store.artifacts
        else:
            uri, artifacts = backend_store_uri, None
        log_path = tracking_store.private_folder("ui") / tracking_store.ui_record_path(uri).with_suffix(".log").name
    except UnsafePathError as error:
        print(f"fanrun: {error}", file=sys.stderr)
        return 1
    port = port if port is not None else _free_port(DEFAULT_PORT)
    url = f"http://{LOOPBACK}:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", LOOPBACK, "--port", str(port),
               "--workers", "1", "--backend-store-uri", uri]
    if artifacts is not None:
        # Experiments made in the UI keep their artifacts beside the store too, where the calls
        # (clients of the sqlite file, not of this server) can write them.
        command += ["--no-serve-artifacts", "--default-artifact-root", artifacts.as_uri()]
    record = None
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as log:
        # GenAI job runner off unless asked for: it starts more processes and leaves queues in /dev/shm.
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}
        # Its own process group, so that stopping it stops its workers too.
        server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
        try:
            if not _wait_answering(server, url + "/health"):
                print(f"fanrun: the MLflow UI did not start (exit status {server.poll()}); its log, {log_path}:\n"
                      f"{_tail(log_path)}", file=sys.stderr)
                return 1
            record = tracking_store.record_ui(uri, url)
            print(f"fanrun: MLflow UI for {uri} at {url} (Ctrl+C stops it; server log: {log_path})", flush=True)
            code = server.wait()
            print(f"fanrun: the MLflow UI ended by itself (exit status {code}); its log:\n{_tail(log_path)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("fanrun: MLflow UI stopped", file=sys.stderr)
            return 0
        finally:
            if record is not None:
                record.unlink(missing_ok=True)
            _stop_group(server)


def _free_port(preferred: int) -> int:
    """`preferred` if nothing listens on it, else one the system picks."""
    for port in (preferred, 0):
        with socket.socket() as probe:
            try:
                probe.bind((LOOPBACK, port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError(f"no free port on {LOOPBACK}")


def _wait_answering(server: subprocess.Popen, url: str) -> bool:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            pass
        # Waiting on the server is the pause between two probes, and ends at once if it exits.
        try:
            server.wait(0.2)
            return False
        except subprocess.TimeoutExpired:
            pass
    return False


def _stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after a grace period; then reaped."""
    for signo in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, signo)
        except ProcessLookupError:
            break
        try:
            server.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
        # The server is gone; what it started may outlive it by a moment.
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    server.wait()


def _tail(path, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as log:
            return "\n".join("    " + line for line in log.read().splitlines()[-lines:])
    except OSError:
        return ""
