"""What the tests' real servers (mlflow server, nginx) share: a free port on 127.0.0.1, a wait
with a deadline until the server answers, and a stop of its whole process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_answering(process: subprocess.Popen, url: str, name: str, deadline_s: float, log_text: Callable[[], str]) -> None:
    """Returns once `url` answers 200; raises with the server's log if it exits or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: {log_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not answering on {url} after {deadline_s:g} s: {log_text()}")
        # Waiting on the process is the pause between two probes, and ends at once if it dies.
        try:
            process.wait(0.1)
        except subprocess.TimeoutExpired:
            pass


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (started with start_new_session), SIGKILL after a
    grace period, then whatever of the group outlived the server itself; then reap."""
    for signo in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signo)
        except ProcessLookupError:
            break
        try:
            process.wait(STOP_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
