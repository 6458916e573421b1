"""Where a tracked call's MLflow runs go when nothing else says so: fanrun's own store, one per
user, and the record a running `fanrun ui` leaves so that a call can link to its run there.

The store is `$XDG_DATA_HOME/fanrun/mlflow` (else `~/.local/share/fanrun/mlflow`): `mlflow.db`, a
sqlite store, with the runs' artifacts in `artifacts/` beside it. Every directory of it is the
user's alone; one that already exists is used only if it is ours and nobody else can write it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .._private_dir import open_private_dir, replace_private

# How long a call waits for a recorded `fanrun ui` server to answer before it names the command instead.
UI_PROBE_TIMEOUT_S = 0.5


_REMEDY = "Fix or remove it, or set MLFLOW_TRACKING_URI to choose where runs go."


@dataclasses.dataclass(frozen=True)
class LocalStore:
    directory: Path

    @property
    def database(self) -> Path:
        return self.directory / "mlflow.db"

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.database}"

    @property
    def artifacts(self) -> Path:
        return self.directory / "artifacts"

    def create(self) -> None:
        """Creates the store, if new, with its artifacts beside it: MLflow would place the default
        experiment's in ./mlruns of whatever the working directory is (an MLflow server, in its
        own artifact service, which a client of the sqlite file cannot write to)."""
        if self.database.exists():
            return
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        SqlAlchemyStore(self.uri, self.artifacts.as_uri())


def data_root() -> Path:
    """fanrun's folder under $XDG_DATA_HOME, else ~/.local/share: data the user keeps, unlike caches."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "fanrun"


def default_store() -> LocalStore:
    """fanrun's store, its folders made private (0700) or checked to be; raises UnsafePathError."""
    return LocalStore(private_folder("mlflow"))


def private_folder(name: str) -> Path:
    """data_root()/name, made private (0700) or checked to be; raises UnsafePathError."""
    path = data_root() / name
    os.close(open_private_dir(path, what="fanrun's MLflow folder", remedy=_REMEDY))
    return path


def is_default_store(uri: str) -> bool:
    return uri == LocalStore(data_root() / "mlflow").uri


# ---------------------------------------------------------------- the record of a running `fanrun ui`


def ui_record_path(store_uri: str) -> Path:
    key = hashlib.sha256(store_uri.encode()).hexdigest()[:16]
    return data_root() / "ui" / f"{key}.json"


def record_ui(store_uri: str, url: str) -> Path:
    """Writes the record under a temporary name, then renames it into place: a call never reads half of one."""
    folder = data_root() / "ui"
    name = ui_record_path(store_uri).name
    dir_fd = open_private_dir(folder, what="fanrun's MLflow folder", remedy=_REMEDY)
    try:
        replace_private(dir_fd, name, json.dumps({"store": store_uri, "url": url, "pid": os.getpid()}).encode())
    finally:
        os.close(dir_fd)
    return folder / name


def ui_address(store_uri: str) -> str | None:
    """The address of a `fanrun ui` server showing this store, if one is up and answers now."""
    try:
        # Only a record of our own names a server worth linking to.
        descriptor = os.open(ui_record_path(store_uri), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(descriptor, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                return None
            record = json.loads(file.read())
        if record.get("store") != store_uri or not str(record.get("url", "")).startswith("http://127.0.0.1:"):
            return None
        os.kill(int(record["pid"]), 0)
        with urllib.request.urlopen(record["url"] + "/health", timeout=UI_PROBE_TIMEOUT_S):
            return record["url"]
    except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError):
        return None


def is_local(uri: str) -> bool:
    """A store in local files (sqlite, file: or a bare path), which `fanrun ui` can show."""
    scheme = urllib.parse.urlsplit(uri).scheme
    return scheme in ("sqlite", "file") or (not scheme and ("/" in uri or uri.startswith(".")))
