"""Directories and files that are the caller's alone, for everything fanrun keeps on disk (runs,
caches, locks, the tracking store). The rule, and every refusal's message, is the engine's:
cpp/include/fanrun/private_dir.h states it once, for the engine's own directories and for these.
A refusal is an UnsafePathError that names the path, says why and what to do; a system call that
fails is the OSError Python raises for its errno (FileNotFoundError, PermissionError, ...).

What stays here is Python's side of it: paths of any kind os.fsencode takes, and files written
from Python's own buffers, whole or not at all (replace_private).
"""

from __future__ import annotations

import os
import secrets

from . import _core

# Opens the file `name` of the directory open at dir_fd without following a link (a file it
# creates is 0600), only if it is a regular file of the caller's that nobody else can read or write.
open_private = _core.open_private


def open_private_dir(path: str | os.PathLike, *, what: str, remedy: str) -> int:
    """A descriptor of `path` (O_DIRECTORY, close-on-exec), made with its missing parents (0700)
    where it does not exist. `what` names the directory in errors ("the cache directory"),
    `remedy` says what to do instead; the caller closes the descriptor."""
    return _core.open_private_dir(os.fsencode(path), what=what, remedy=remedy)


def open_private_subdir(parent_fd: int, name: str, parent_path: str | os.PathLike, *, what: str, remedy: str) -> int:
    """A descriptor of the subdirectory `name` of a private directory, made 0700 where missing,
    with the same checks; one of fanrun's own found with a wider mode is narrowed to 0700."""
    return _core.open_private_subdir(parent_fd, name, os.fsencode(parent_path), what=what, remedy=remedy)


def replace_private(dir_fd: int, name: str, *chunks: bytes) -> None:
    """Writes the file `name` in the directory `dir_fd` whole or not at all: 0600, under a
    temporary name of its own, fsynced, then renamed into place. A reader sees the old file or
    the new one, and writers in several processes never mix."""
    temporary = f".{name}.{os.getpid()}.{secrets.token_hex(3)}"
    fd = open_private(dir_fd, temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        _write_all(fd, chunks)
        os.fsync(fd)
    except BaseException:
        os.unlink(temporary, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)
    os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def create_private(dir_fd: int, name: str, *chunks: bytes, sync: bool = True) -> None:
    """Writes the new file `name` in the directory `dir_fd` whole or not at all, as replace_private
    does, but never over another: linked into place, it is FileExistsError where `name` exists,
    so that of several writers exactly one wins. `sync`: fsynced first (a file that must outlive a
    crash of the machine). No file is replaced, which costs ext4 a flush of the new one's data
    (auto_da_alloc): a millisecond, that a call would pay for each file so written."""
    temporary = f".{name}.{os.getpid()}.{secrets.token_hex(3)}"
    fd = open_private(dir_fd, temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            _write_all(fd, chunks)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.link(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.unlink(temporary, dir_fd=dir_fd)


def _write_all(fd: int, chunks: tuple[bytes, ...]) -> None:
    for chunk in chunks:
        with memoryview(chunk) as view:
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
