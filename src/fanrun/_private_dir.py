"""Directories only their owner can write, for what fanrun keeps on disk: opened (or made, 0700)
one component at a time without following links, each checked on its descriptor.

The rule (the engine's cpp/src/private_dir.cc applies the same one to the directories it opens):
the directory itself belongs to the caller and nobody else can write it; each directory above it
belongs to the caller or to root and nobody else can write it, unless it is sticky (as /tmp is),
so that no one can move another directory in place of the one checked. Files inside are then
opened relative to the returned descriptor (``dir_fd=``) with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import errno
import os
import stat

from ._errors import UnsafeDirectoryError

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(path: str | os.PathLike, *, what: str, remedy: str) -> int:
    """A descriptor of `path` (O_DIRECTORY), made with its missing parents (mode 0700, whatever
    the umask) where it does not exist. `what` names the directory in errors ("The cache
    directory"), and `remedy` says what to do instead; the caller closes the descriptor."""
    canonical = os.path.realpath(os.path.abspath(os.fspath(path)))
    parts = [part for part in canonical.split("/") if part]
    if not parts:
        raise UnsafeDirectoryError(f"{what} cannot be '/'. {remedy}")
    fd = os.open("/", _DIRECTORY_FLAGS)
    walked = "/"
    try:
        _check_above(os.fstat(fd), walked, what, remedy)
        for i, part in enumerate(parts):
            walked = os.path.join(walked, part)
            child = _open_or_make(fd, part, walked, what, remedy)
            os.close(fd)
            fd = child
            if i + 1 == len(parts):
                _check_own(os.fstat(fd), walked, what, remedy)
            else:
                _check_above(os.fstat(fd), walked, what, remedy)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_private_subdir(parent_fd: int, name: str, parent_path: str, *, what: str, remedy: str) -> int:
    """A descriptor of the subdirectory `name` of a private directory, made 0700 where missing,
    with the same checks; one of fanrun's own found with a wider mode is narrowed to 0700."""
    path = os.path.join(parent_path, name)
    fd = _open_or_make(parent_fd, name, path, what, remedy)
    try:
        st = os.fstat(fd)
        _check_own(st, path, what, remedy)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_or_make(parent_fd: int, name: str, path: str, what: str, remedy: str) -> int:
    for _ in range(2):
        try:
            return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeDirectoryError(f"{what}: '{path}' is a symbolic link or not a directory, and fanrun "
                                           f"does not follow links there. {remedy}") from None
            raise
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            continue  # made by another process meanwhile: open it as it is
        except OSError as error:
            raise OSError(error.errno, f"{what}: could not create '{path}': {error.strerror}. {remedy}") from None
        fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent_fd)
        os.fchmod(fd, 0o700)  # mkdir's mode went through the umask
        return fd
    raise FileNotFoundError(f"{what}: '{path}' vanished while it was opened")


def _check_own(st: os.stat_result, path: str, what: str, remedy: str) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeDirectoryError(
            f"{what} '{path}' belongs to uid {st.st_uid}, not to you (uid {me}): its owner could plant files "
            f"that fanrun would serve, or read what fanrun writes there. {remedy}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(
            f"{what} '{path}' can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}): they could plant "
            f"files or links in it. Remove their write access (chmod go-w '{path}'), or: {remedy}")


def _check_above(st: os.stat_result, path: str, what: str, remedy: str) -> None:
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise UnsafeDirectoryError(
            f"{what} lies under '{path}', which belongs to uid {st.st_uid}: that user could move another directory "
            f"in its place. {remedy}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectoryError(
            f"{what} lies under '{path}', which other users can write (mode {stat.S_IMODE(st.st_mode):04o}) and is "
            f"not sticky: they could move another directory in its place. {remedy}")
