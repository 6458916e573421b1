"""Idempotency keys of `fanrun submit`: each names the run that claimed it first, in a private
folder beside the records (<runs root>/records/keys), under the hash of the key."""

from __future__ import annotations

import hashlib
import os
import secrets

from .._launch import records
from .._private_dir import open_private, open_private_subdir


def claim(key: str, run_id: str) -> str:
    """The run of idempotency key `key`: `run_id` if this call is the first to claim the key,
    else the run that claimed it first (a link is made or fails as one step)."""
    parent, parent_fd = records.root()
    try:
        keys_fd = open_private_subdir(parent_fd, "keys", str(parent), what="fanrun's idempotency keys",
                                      remedy="Remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a "
                                      "directory of your own.")
    finally:
        os.close(parent_fd)
    try:
        name = hashlib.sha256(key.encode()).hexdigest()
        temporary = f".{name}.{os.getpid()}.{secrets.token_hex(3)}"
        fd = open_private(keys_fd, temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, run_id.encode())
        finally:
            os.close(fd)
        try:
            os.link(temporary, name, src_dir_fd=keys_fd, dst_dir_fd=keys_fd)
            return run_id
        except FileExistsError:
            fd = open_private(keys_fd, name, os.O_RDONLY)
            try:
                return os.read(fd, 256).decode()
            finally:
                os.close(fd)
        finally:
            os.unlink(temporary, dir_fd=keys_fd)
    finally:
        os.close(keys_fd)
