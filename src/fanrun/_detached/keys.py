"""Idempotency keys of `fanrun submit`: each names the run that claimed it first, in a private
folder beside the records (<runs root>/records/keys), under the hash of the key."""

from __future__ import annotations

import hashlib
import os

from .._launch import records
from .._private_dir import create_private, open_private, open_private_subdir


def claim(key: str, run_id: str) -> str:
    """The run of idempotency key `key`: `run_id` if this call is the first to claim the key,
    else the run that claimed it first (its file is made or not, as one step)."""
    parent, parent_fd = records.root()
    try:
        keys_fd = open_private_subdir(parent_fd, "keys", str(parent), what="fanrun's idempotency keys",
                                      remedy="Remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a "
                                      "directory of your own.")
    finally:
        os.close(parent_fd)
    try:
        name = hashlib.sha256(key.encode()).hexdigest()
        try:
            create_private(keys_fd, name, run_id.encode())
            return run_id
        except FileExistsError:
            fd = open_private(keys_fd, name, os.O_RDONLY)
            try:
                return os.read(fd, 256).decode()
            finally:
                os.close(fd)
    finally:
        os.close(keys_fd)
