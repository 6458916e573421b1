"""The private-directory rule as Python meets it: stated once, in the engine (private_dir.h), its
refusals UnsafePathError with the engine's message, its failed system calls the OSError Python
raises for their errno."""

from __future__ import annotations

import errno
import os
import pickle
import stat

import pytest

from fanrun import EngineOSError, FanrunError, UnsafePathError
from fanrun._private_dir import open_private, open_private_dir, open_private_subdir, replace_private

WHAT, REMEDY = "The test directory", "Use another one."


def test_a_directory_is_made_0700_level_by_level_and_files_0600(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = os.umask(0)
    try:
        fd = open_private_dir(tmp_path / "a" / "b", what=WHAT, remedy=REMEDY)
        try:
            sub = open_private_subdir(fd, "files", tmp_path / "a" / "b", what=WHAT, remedy=REMEDY)
            os.close(sub)
            replace_private(fd, "whole", b"one ", memoryview(b"two"))
        finally:
            os.close(fd)
    finally:
        os.umask(old)
    for made in ("a", "a/b", "a/b/files"):
        assert stat.S_IMODE((tmp_path / made).stat().st_mode) == 0o700, made
    assert (tmp_path / "a/b/whole").read_bytes() == b"one two"
    assert stat.S_IMODE((tmp_path / "a/b/whole").stat().st_mode) == 0o600


def test_a_refusal_is_an_unsafe_path_error_that_names_the_path_why_and_what_to_do(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafePathError) as refused:
        open_private_dir(shared, what=WHAT, remedy=REMEDY)
    assert isinstance(refused.value, PermissionError) and isinstance(refused.value, FanrunError)
    assert str(refused.value) == (
        f"{WHAT} '{shared}' can be written by other users (mode 0777): they could plant files or links in it. "
        f"Remove their write access (chmod go-w '{shared}'), or: {REMEDY}")
    with pytest.raises(UnsafePathError, match=r"which other users can write \(mode 0777\) and is not sticky"):
        open_private_dir(shared / "mine", what=WHAT, remedy=REMEDY)
    assert list(shared.iterdir()) == []


def test_files_are_never_opened_through_a_link_nor_when_others_can_read_them(tmp_path):
    (tmp_path / "real").write_bytes(b"")
    (tmp_path / "real").chmod(0o644)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(UnsafePathError, match="^link is a symbolic link, and fanrun follows none in its own directories$"):
            open_private(fd, "link", os.O_RDONLY)
        with pytest.raises(UnsafePathError, match=r"^others can read or write real \(mode 0644\)$"):
            open_private(fd, "real", os.O_RDONLY)
        with pytest.raises(ValueError, match="is not the name of an entry in its directory"):
            open_private(fd, "../escaped", os.O_RDWR | os.O_CREAT)
    finally:
        os.close(fd)
    assert not (tmp_path.parent / "escaped").exists()


def test_a_failed_system_call_is_the_oserror_of_its_errno_and_an_engine_error_pickled_whole(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError) as missing:
            open_private(fd, "missing", os.O_RDONLY)
    finally:
        os.close(fd)
    error = missing.value
    assert isinstance(error, EngineOSError) and error.errno == errno.ENOENT
    assert str(error) == "Failed to open 'missing': No such file or directory (errno 2)"
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.errno, str(again)) == (type(error), errno.ENOENT, str(error))
    assert isinstance(again, FileNotFoundError)
