"""Directories and files that are the caller's alone: made 0700 and 0600, accepted only when
the caller owns them and nobody else can write them, opened through a descriptor, never through a link."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ._errors import FanrunError

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(PermissionError, FanrunError):
    """A directory or file fanrun would use is not the caller's alone: another user owns it,
    others can write it, or it is a symbolic link."""


def ensure_private_dir(path: str | os.PathLike, create: bool = True, *, under: str | os.PathLike | None = None) -> int:
    """Opens the directory `path` and returns its descriptor (close-on-exec).

    Every level below `under` (default: `path`'s parent), down to `path` itself, is opened
    without following links and must be owned by the caller and writable by nobody else;
    with `create`, missing levels are made 0700 whatever the umask. Where `under` does not
    exist, the levels start at its nearest existing ancestor. `under` itself may be a link
    and anyone's (/tmp is root's and everyone's); nothing is made or checked above it."""
    target = Path(os.path.abspath(path))
    top = Path(os.path.abspath(under)) if under is not None else target.parent
    if top not in target.parents:
        raise ValueError(f"{top} is not above {target}")
    while not top.is_dir() and top != top.parent:
        top = top.parent
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = top
    try:
        for name in target.relative_to(top).parts:
            where = where / name
            made = False
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass  # another process's, or a plant: checked below like any existing level
            child = _open_level(fd, name, where)
            os.close(fd)
            fd = child
            if made:
                os.fchmod(fd, 0o700)  # mkdir's mode is cut by the umask; a 0 umask would leave it wide open
            _check_ours(os.fstat(fd), where, writable_only=True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_private(dir_fd: int, name: str, flags: int) -> int:
    """Opens `name` in the directory `dir_fd` without following a link; a file it creates is
    0600. Returns the descriptor (close-on-exec) only if it is a regular file of the caller's
    that nobody else can read or write."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafePathError(f"{name} is a symbolic link, and fanrun follows none in its own directories") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{name} is not a regular file")
        _check_ours(info, Path(name), writable_only=False)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_level(parent_fd: int, name: str, where: Path) -> int:
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent_fd)
    except OSError as error:
        # O_NOFOLLOW with O_DIRECTORY reports a link as "not a directory".
        if error.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(os.lstat(name, dir_fd=parent_fd).st_mode):
            target = os.readlink(name, dir_fd=parent_fd)
            raise UnsafePathError(
                f"{where} is a symbolic link (to {target}), and fanrun follows no link to a directory it writes in"
            ) from None
        raise OSError(error.errno, error.strerror, str(where)) from None


def _check_ours(info: os.stat_result, where: Path, *, writable_only: bool) -> None:
    me = os.geteuid()
    if info.st_uid != me:
        raise UnsafePathError(
            f"{where} belongs to uid {info.st_uid}, not to you (uid {me}): that user could plant files in it that fanrun would load"
        )
    others = stat.S_IMODE(info.st_mode) & (0o022 if writable_only else 0o077)
    if others:
        access = "write" if writable_only else "read or write"
        raise UnsafePathError(f"others can {access} {where} (mode {stat.S_IMODE(info.st_mode):04o})")
