"""A real `mlflow server` on 127.0.0.1 for the tests: started on a free port, waited for through
its /health endpoint with a deadline, and stopped with its whole process group; and a proxy in
front of it that makes chosen steps slow."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
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


class SlowProxy:
    """A tracking store that is slow at chosen steps: an HTTP proxy on 127.0.0.1 in front of a real
    server, holding each request whose path starts with a key of `delays` for that many seconds
    before passing it on. `answered[path]` holds when each such request's answer was sent."""

    def __init__(self, target: str, delays: dict[str, float]) -> None:
        self.target = target.rstrip("/")
        self.delays = delays
        self.answered: dict[str, list[float]] = {prefix: [] for prefix in delays}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                delayed = [prefix for prefix in proxy.delays if self.path.startswith(prefix)]
                for prefix in delayed:
                    time.sleep(proxy.delays[prefix])
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                request = urllib.request.Request(proxy.target + self.path, data=body if body else None,
                                                 headers=headers, method=self.command)
                try:
                    with urllib.request.urlopen(request, timeout=60) as answer:
                        status, content_type, data = answer.status, answer.headers.get("Content-Type"), answer.read()
                except urllib.error.HTTPError as error:
                    status, content_type, data = error.code, error.headers.get("Content-Type"), error.read()
                self.send_response(status)
                if content_type:
                    self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
                for prefix in delayed:
                    proxy.answered[prefix].append(time.time())

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
