"""Directories and files that are the caller's alone, for everything fanrun keeps on disk (runs,
caches): opened, or made 0700 and 0600 whatever the umask, one component at a time without
following a link, and each checked on its descriptor.

The rule (the engine's cpp/src/private_dir.cc applies the same one to the directories it opens):
the directory itself belongs to the caller and nobody else can write it, and is not a link;
each directory above it belongs to the caller or to root and nobody else can write it, unless it
is sticky (as /tmp is), so that no one can move another directory in place of the one checked.
A link above the directory (a home under /data, say) is followed only where it belongs to root
or to the caller, and what it leads to is checked the same way. Files inside are opened relative
to the returned descriptor with O_NOFOLLOW.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from ._errors import UnsafePathError

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(path: str | os.PathLike, *, what: str, remedy: str, create: bool = True) -> int:
    """A descriptor of `path` (O_DIRECTORY, close-on-exec), made with its missing parents (0700)
    where it does not exist and `create` is set. `what` names the directory in errors ("the
    cache directory"), `remedy` says what to do instead; the caller closes the descriptor."""
    absolute = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(absolute)
    if not name:
        raise UnsafePathError(f"{what} cannot be '/'. {remedy}")
    parts = [part for part in parent.split("/") if part] + [name]
    fd = os.open("/", _DIRECTORY_FLAGS)
    walked = "/"
    try:
        _check_above(os.fstat(fd), walked, what, remedy)
        for i, part in enumerate(parts):
            walked = os.path.join(walked, part)
            last = i + 1 == len(parts)
            child = _open_or_make(fd, part, walked, what, remedy, create, follow_trusted_link=not last)
            os.close(fd)
            fd = child
            if last:
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
    fd = _open_or_make(parent_fd, name, path, what, remedy, create=True, follow_trusted_link=False)
    try:
        st = os.fstat(fd)
        _check_own(st, path, what, remedy)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_private(dir_fd: int, name: str, flags: int) -> int:
    """Opens the file `name` in the directory `dir_fd` without following a link; a file it creates
    is 0600. Returns the descriptor (close-on-exec) only if it is a regular file of the caller's
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
        me = os.geteuid()
        if info.st_uid != me:
            raise UnsafePathError(f"{name} belongs to uid {info.st_uid}, not to you (uid {me})")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise UnsafePathError(f"others can read or write {name} (mode {stat.S_IMODE(info.st_mode):04o})")
        return fd
    except BaseException:
        os.close(fd)
        raise


def replace_private(dir_fd: int, name: str, *chunks: bytes) -> None:
    """Writes the file `name` in the directory `dir_fd` whole or not at all: 0600, under a
    temporary name of its own, fsynced, then renamed into place. A reader sees the old file or
    the new one, and writers in several processes never mix."""
    temporary = f".{name}.{os.getpid()}.{secrets.token_hex(3)}"
    fd = open_private(dir_fd, temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        for chunk in chunks:
            with memoryview(chunk) as view:
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
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
            for chunk in chunks:
                with memoryview(chunk) as view:
                    written = 0
                    while written < len(view):
                        written += os.write(fd, view[written:])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.link(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.unlink(temporary, dir_fd=dir_fd)


def _open_or_make(parent_fd: int, name: str, path: str, what: str, remedy: str, create: bool,
                  follow_trusted_link: bool) -> int:
    for _ in range(2):
        try:
            return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as error:
            # O_NOFOLLOW with O_DIRECTORY reports a link as "not a directory".
            link = os.lstat(name, dir_fd=parent_fd) if error.errno in (errno.ELOOP, errno.ENOTDIR) else None
            if link is None or not stat.S_ISLNK(link.st_mode):
                raise OSError(error.errno, f"{what}: '{path}': {error.strerror}", path) from None
            if not follow_trusted_link:
                raise UnsafePathError(f"{what}: '{path}' is a symbolic link, and fanrun follows no link to the "
                                      f"directory it keeps files in. {remedy}") from None
            if link.st_uid not in (0, os.geteuid()):
                raise UnsafePathError(f"{what}: '{path}' is a symbolic link made by uid {link.st_uid}, and fanrun "
                                      f"follows no link that another user made. {remedy}") from None
            # Made by root or the caller, in a directory only they can change: what it leads to is
            # opened, and checked like any other level.
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd)
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
        raise UnsafePathError(
            f"{what} '{path}' belongs to uid {st.st_uid}, not to you (uid {me}): its owner could plant files "
            f"that fanrun would load, or read what fanrun writes there. {remedy}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(
            f"{what} '{path}' can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}): they could plant "
            f"files or links in it. Remove their write access (chmod go-w '{path}'), or: {remedy}")


def _check_above(st: os.stat_result, path: str, what: str, remedy: str) -> None:
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise UnsafePathError(
            f"{what} lies under '{path}', which belongs to uid {st.st_uid}: that user could move another directory "
            f"in its place. {remedy}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            f"{what} lies under '{path}', which other users can write (mode {stat.S_IMODE(st.st_mode):04o}) and is "
            f"not sticky: they could move another directory in its place. {remedy}")
