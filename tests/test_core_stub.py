"""fanrun._core's stub is generated from the bindings at build time (nanobind's stubgen), never
written by hand: the installed stub is what stubgen makes of the installed module, and it names
every public name of the module."""

from __future__ import annotations

import ast
import enum
import inspect
import subprocess
import sys
from pathlib import Path

from fanrun import _core

STUB = Path(_core.__file__).with_name("_core.pyi")


def test_the_installed_stub_is_what_stubgen_makes_of_the_installed_module(tmp_path):
    """A stub that differs from the bindings it was installed with is stale."""
    fresh = tmp_path / "_core.pyi"
    made = subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "fanrun._core", "-o", str(fresh)],
        capture_output=True, text=True, timeout=120,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    assert STUB.read_text() == fresh.read_text(), f"{STUB} is stale: rebuild fanrun (make setup)"


def test_the_stub_names_every_public_name_of_the_module():
    """Every public function, class, constant and member of _core has its line in the stub."""
    tree = ast.parse(STUB.read_text())
    in_stub = _names(tree.body)
    public = {name for name in dir(_core) if not name.startswith("_")}
    assert public - set(in_stub) == set()
    for name in public:
        value = getattr(_core, name)
        if not inspect.isclass(value):
            continue
        members = {member for member in vars(value) if not member.startswith("_")}
        if issubclass(value, enum.Enum):  # its members, not enum's machinery
            members = set(value.__members__)
        assert members - set(_names(in_stub[name].body)) == set(), name


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """What a module's or a class's body defines, by name."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            names.update({target.id: node for target in node.targets if isinstance(target, ast.Name)})
    return names
