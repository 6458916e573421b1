"""RunPaths: every file of one run, built in one place, in a directory only the caller's user can read."""

from __future__ import annotations

import datetime
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

# Older run directories beyond this many are removed when a new run starts.
KEEP_RUNS = 100


def runs_root() -> Path:
    """$FANRUN_RUNS_DIR, else ~/.cache/fanrun/runs (or a private temp folder when home is read-only)."""
    configured = os.environ.get("FANRUN_RUNS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = Path(cache) / "fanrun" / "runs"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return root
    except OSError:
        return Path(tempfile.gettempdir()) / f"fanrun-{os.getuid()}" / "runs"


class RunPaths:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.run_id = directory.name

    @classmethod
    def create(cls, name: str) -> RunPaths:
        root = runs_root()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "run"
        directory = root / f"{stamp}-{safe}-{secrets.token_hex(3)}"
        # mode 0700 whatever the umask: payloads and results are the caller's alone.
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)
        _prune(root, keep=KEEP_RUNS)
        return cls(directory)

    @property
    def payload(self) -> Path:
        return self.directory / "payload.pkl"

    def log(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.log"

    def result(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.result"

    def error(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.error"

    def remove_bulky_files(self, world_size: int) -> None:
        """Keeps logs and error files; drops the payload and results, which can be large."""
        for path in [self.payload, *(self.result(r) for r in range(world_size))]:
            path.unlink(missing_ok=True)


def write_private(path: Path, *chunks: bytes) -> None:
    """Writes a file readable by its owner alone: a temporary name, fsync, then rename."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        for chunk in chunks:
            with memoryview(chunk) as view:
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _prune(root: Path, keep: int) -> None:
    runs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name)
    for old in runs[:-keep] if len(runs) > keep else []:
        shutil.rmtree(old, ignore_errors=True)
