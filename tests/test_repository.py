"""The repository itself: no tracked file holds what a merge left unresolved."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# git writes these at the start of a line, seven characters long, followed by a space and a
# name or by the end of the line; "=======" alone is left out, as a heading underline may be it.
CONFLICT_MARKER = re.compile(rb"^(<{7}|\|{7}|>{7})( |\r?$)", re.MULTILINE)


def conflict_lines(text: bytes) -> list[int]:
    return [text.count(b"\n", 0, found.start()) + 1 for found in CONFLICT_MARKER.finditer(text)]


def test_the_marker_check_finds_a_conflict_as_git_writes_it():
    merged = b"a\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> topic\nb\n<<<<<<<\n"
    assert conflict_lines(merged) == [2, 6, 8]
    assert conflict_lines(b"a <<<<<<< b\n<<<<<<<< eight\n=======\n") == []


def test_no_tracked_file_holds_a_merge_conflict():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = []
    for name in filter(None, names.decode().split("\0")):
        path = ROOT / name
        if path.is_file() and not path.is_symlink():
            found += [f"{name}:{line}" for line in conflict_lines(path.read_bytes())]
    assert found == [], f"merge conflict markers in tracked files: {found}"
