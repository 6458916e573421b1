"""RunPaths: every file of one run, built in one place, in a directory only the caller's user can read.

The runs root may hold other things than fanrun's runs (a user's FANRUN_RUNS_DIR can be any
folder). A directory there is a run of fanrun's only if its name has fanrun's pattern, it is
the caller's, and it holds RUN_MARKER, a file its caller keeps locked (flock) for as long as
the call lasts. Pruning removes only such runs, and only when nobody holds their lock: a live
call is never pruned, and a crashed caller's lock dies with its process.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

from .._errors import UnsafePathError
from .._private_dir import open_private, open_private_dir, replace_private
from .._rank.contract import PAYLOAD, RUN_MARKER, error_name, log_name, result_name

# Finished runs beyond the newest this many are removed when a new run starts.
KEEP_RUNS = 100
# A run directory's name: the time to the microsecond (so names sort oldest first), the
# function's name, and a random part.
_RUN_NAME = re.compile(r"\d{8}-\d{6}-\d{6}-[A-Za-z0-9_.-]{1,40}-[0-9a-f]{6}")
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


_ROOT_REMEDY = (
    "Use a directory that you own and that only you can write: fix this one (chown it to yourself, chmod 700), "
    "remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a directory of your own (its real path, "
    "not a link)."
)


def open_runs_root() -> tuple[Path, int]:
    """The runs root and a descriptor of it: $FANRUN_RUNS_DIR, else $XDG_CACHE_HOME/fanrun/runs
    (~/.cache by default), else, where that cannot be made, $TMPDIR/fanrun-<uid>/runs.
    A root that is not the caller's alone is refused (UnsafePathError), never replaced."""
    configured = os.environ.get("FANRUN_RUNS_DIR")
    if configured:
        return _open_root(Path(configured))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))
    try:
        return _open_root(cache / "fanrun" / "runs")
    except UnsafePathError:
        raise
    except OSError:
        # A read-only or broken home. In a shared $TMPDIR, every level made there is checked.
        return _open_root(Path(tempfile.gettempdir()) / f"fanrun-{os.getuid()}" / "runs")


def _open_root(path: Path) -> tuple[Path, int]:
    path = Path(os.path.abspath(path))
    return path, open_private_dir(path, what="fanrun's runs directory", remedy=_ROOT_REMEDY)


def rank_log(run_dir: Path, rank: int) -> Path:
    """A rank's full log in its run's directory."""
    return run_dir / log_name(rank)


def open_run_directory(path: str) -> tuple[Path, int] | None:
    """A run directory that a record names (_launch/records.py), and a descriptor of it: only
    one that lies in the runs root itself, has a run directory's name and is the caller's (never
    a link); None where it is gone, or is none of these."""
    root, root_fd = open_runs_root()
    try:
        name = os.path.basename(path)
        if os.path.dirname(os.path.abspath(path)) != str(root) or not _RUN_NAME.fullmatch(name):
            return None
        try:
            dir_fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=root_fd)
        except OSError:
            return None
        if os.fstat(dir_fd).st_uid != os.geteuid():
            os.close(dir_fd)
            return None
        return root / name, dir_fd
    finally:
        os.close(root_fd)


class RunPaths:
    """One attempt's directory, held open and locked from create() until close()."""

    def __init__(self, directory: Path, dir_fd: int, lock_fd: int, run_id: str | None = None) -> None:
        self.directory = directory
        # The id of the run this attempt is of (its record's, _launch/records.py): the one a
        # person is shown and types.
        self.run_id = run_id or directory.name
        self._dir_fd = dir_fd
        self._lock_fd = lock_fd

    @classmethod
    def create(cls, name: str, run_id: str | None = None) -> RunPaths:
        root, root_fd = open_runs_root()
        try:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "run"
            run_name = f"{stamp}-{safe}-{secrets.token_hex(3)}"
            # mkdir is atomic and fails where the name exists: a run never reuses a directory.
            os.mkdir(run_name, 0o700, dir_fd=root_fd)
            dir_fd = os.open(run_name, _DIRECTORY_FLAGS, dir_fd=root_fd)
            paths = cls(root / run_name, dir_fd, -1, run_id)
            try:
                os.fchmod(dir_fd, 0o700)  # whatever the umask: payloads and results are the caller's alone
                paths._lock_fd = _hold_marker(dir_fd)
                _prune(root_fd, keep=KEEP_RUNS)
            except BaseException:
                paths.close()
                raise
            return paths
        finally:
            os.close(root_fd)

    @property
    def payload(self) -> Path:
        return self.directory / PAYLOAD

    def log(self, rank: int) -> Path:
        return rank_log(self.directory, rank)

    def result(self, rank: int) -> Path:
        return self.directory / result_name(rank)

    def error(self, rank: int) -> Path:
        return self.directory / error_name(rank)

    def write_payload(self, *chunks: bytes) -> None:
        """Writes the payload, 0600, under a temporary name, fsynced, then renamed into place."""
        self.write_file(self.payload.name, *chunks)

    def write_file(self, name: str, *chunks: bytes) -> None:
        """Writes a file of the run (the payload; a rank's result, error or log that a cluster's
        node sent back), 0600, whole or not at all (_private_dir.replace_private)."""
        replace_private(self._dir_fd, name, *chunks)

    def rewrite_file(self, name: str, data: bytes) -> None:
        """Overwrites a small file of the run in place, 0600, made where missing: one rewritten
        every second (a node's rank's progress record, mirrored here), whose readers read it
        whole, as they read the record the rank itself rewrites in place."""
        fd = open_private(self._dir_fd, name, os.O_WRONLY | os.O_CREAT)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)

    def remove_file(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass

    def open_result(self, rank: int) -> BinaryIO:
        """A rank's result file, opened in the run directory only if it is private to the caller."""
        return os.fdopen(open_private(self._dir_fd, self.result(rank).name, os.O_RDONLY), "rb")

    def remove_bulky_files(self, world_size: int) -> None:
        """Keeps logs and error files; drops the payload and results, which can be large."""
        for path in [self.payload, *(self.result(r) for r in range(world_size))]:
            self.remove_file(path.name)

    def close(self) -> None:
        """Ends the run's hold on its directory: from now on it may be pruned."""
        for fd in (self._lock_fd, self._dir_fd):
            if fd >= 0:
                os.close(fd)
        self._lock_fd = self._dir_fd = -1

    def __enter__(self) -> RunPaths:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _hold_marker(dir_fd: int) -> int:
    """Creates the run's marker already locked, under a temporary name renamed into place:
    a pruner never finds the marker of a live run unlocked."""
    pending = RUN_MARKER + ".new"
    fd = open_private(dir_fd, pending, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can have this new file open: never waits
        os.rename(pending, RUN_MARKER, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _prune(root_fd: int, keep: int) -> None:
    """Removes the oldest finished runs beyond the newest `keep`; nothing else is touched."""
    with os.scandir(root_fd) as entries:
        names = sorted(e.name for e in entries if _RUN_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    for name in names[: max(0, len(names) - keep)]:
        _remove_if_finished(root_fd, name)


def _remove_if_finished(root_fd: int, name: str) -> None:
    try:
        dir_fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=root_fd)
    except OSError:
        return  # removed meanwhile by another caller's pruning, or not a directory
    try:
        if os.fstat(dir_fd).st_uid != os.geteuid():
            return
        try:
            marker = open_private(dir_fd, RUN_MARKER, os.O_RDONLY)
        except OSError:
            return  # no marker of the caller's (or a link): not a run fanrun made
        try:
            fcntl.flock(marker, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(marker)
            return  # its caller is alive
        try:
            # The lock is held while removing: another pruner finds the marker locked, or gone.
            shutil.rmtree(name, dir_fd=root_fd, ignore_errors=True)
        finally:
            os.close(marker)
    finally:
        os.close(dir_fd)
