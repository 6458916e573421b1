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


def test_the_readme_front_page_is_short_and_every_link_it_gives_exists():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) < 8 * 1024, f"README.md is {len(readme)} bytes: keep the front page under 8 KB, the rest in docs/"
    links = re.findall(rb"\]\(([^)#\s]+)", readme)
    assert links, "README.md links to no page"
    missing = [link.decode() for link in links if b"://" not in link and not (ROOT / link.decode()).exists()]
    assert missing == [], f"README.md links to pages that do not exist: {missing}"
