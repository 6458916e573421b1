"""A real `mlflow server` on 127.0.0.1 for the tests: started on a free port, waited for through
its /health endpoint with a deadline, and stopped with its whole process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from server_process import free_port, stop_group, wait_answering

START_DEADLINE_S = 90.0


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
            wait_answering(self._process, self.url + "/health", "mlflow server", START_DEADLINE_S, self.log_text)
        except BaseException:
            self.stop()
            raise

    def log_text(self) -> str:
        self._log.flush()
        return (self.directory / "server.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        stop_group(self._process)
        self._log.close()
