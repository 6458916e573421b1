"""A real `mlflow server` on 127.0.0.1 for the tests: started on a free port, waited for through
its /health endpoint with a deadline, and stopped with its whole process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

START_DEADLINE_S = 90.0
STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(directory / "server.log", "wb")
        mlflow = Path(sys.executable).with_name("mlflow")
        self._process = subprocess.Popen(
            [
                str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                "--backend-store-uri", f"sqlite:///{directory / 'server.db'}",
                "--artifacts-destination", str(directory / "artifacts"),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # No GenAI job runner: the tests use none, and it leaves its queues in /dev/shm.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            # Its own process group: the server's workers are stopped together with it.
            start_new_session=True,
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self._process.returncode}: {self.log_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not healthy after {START_DEADLINE_S:g} s: {self.log_text()}")
            # Waiting on the process doubles as the pause between two probes, and returns at
            # once if the server dies.
            try:
                self._process.wait(0.25)
            except subprocess.TimeoutExpired:
                pass

    def log_text(self) -> str:
        self._log.flush()
        return (self.directory / "server.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after a grace period, then reap."""
        for signo, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            try:
                os.killpg(self._process.pid, signo)
            except ProcessLookupError:
                break
            try:
                self._process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Workers left in the group after the server itself exited go too.
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.wait()
        self._log.close()
