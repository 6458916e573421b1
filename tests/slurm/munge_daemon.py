"""A private munged for the local Slurm cluster: its key, socket, pid, seed and log all in a folder
of the cluster's own, so that nothing system-wide (/etc/munge, /run/munge) is read or written."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from daemon import Daemon

KEY_BYTES = 1024


class MungeFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key = directory / "munge.key"
        self.socket = directory / "munge.socket"
        self.pid = directory / "munged.pid"
        self.seed = directory / "munged.seed"
        self.log = directory / "munged.log"


def write_munge_key(path: Path) -> None:
    """A new random key, 0400 and owned by this user, as munged insists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
    finally:
        os.close(fd)


def start_munged(files: MungeFiles, env: dict[str, str]) -> Daemon:
    """Returns once munged accepts on its socket: started without --foreground, munged's first
    process exits only when the daemon it forks is ready, or with the reason it is not."""
    started = subprocess.run(
        ["munged", f"--socket={files.socket}", f"--key-file={files.key}", f"--pid-file={files.pid}",
         f"--seed-file={files.seed}", f"--log-file={files.log}"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    if started.returncode != 0:
        raise RuntimeError(f"munged exited with {started.returncode}: {started.stderr.strip()}")
    return Daemon("munged", int(files.pid.read_text()))
