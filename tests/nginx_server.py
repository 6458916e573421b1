"""A real nginx on 127.0.0.1 for the data tests: serves a directory with autoindex (so that
fsspec's HTTP filesystem can list it) from a configuration generated in a private folder,
on a free port; waited for with a deadline, stopped with its workers."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

from server_process import free_port, stop_group, wait_answering

START_DEADLINE_S = 30.0

CONFIG = """\
{user}daemon off;
master_process on;
worker_processes 2;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    sendfile on;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ autoindex on; }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


class NginxServer:
    def __init__(self, root: Path, directory: Path) -> None:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed: `make test-python` installs Debian's nginx-light")
        self.root = root
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "nginx.conf"
        # Started as root, nginx would drop its workers to an account that cannot read the
        # test's private folders: keep them as the test's own user.
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
        config.write_text(CONFIG.format(user=user, dir=directory, port=self.port, root=root))
        self._log = open(directory / "stderr.log", "wb")
        self._process = subprocess.Popen(
            [binary, "-p", str(directory), "-c", str(config), "-e", str(directory / "error.log")],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its workers are stopped together with it
        )
        try:
            wait_answering(self._process, self.url + "/", "nginx", START_DEADLINE_S, self.log_text)
        except BaseException:
            self.stop()
            raise

    def log_text(self) -> str:
        self._log.flush()
        text = (self.directory / "stderr.log").read_text(errors="replace")
        error_log = self.directory / "error.log"
        if error_log.exists():
            text += error_log.read_text(errors="replace")
        return text[-3000:]

    def stop(self) -> None:
        stop_group(self._process)  # SIGTERM is nginx's fast shutdown
        self._log.close()
