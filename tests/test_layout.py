"""The layers keep to their side: what runs inside a rank loads none of the caller's machinery."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def modules_after(code: str) -> set[str]:
    probe = textwrap.dedent(code) + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_importing_fanrun_data_loads_no_launcher_tracking_or_mlflow():
    loaded = modules_after("import fanrun.data")
    caller_side = {m for m in loaded if m.split(".")[0] == "mlflow"} | {
        m for m in loaded
        if m in ("fanrun._decorator", "fanrun._spec.payload", "fanrun._torch_distributor")
        or m.startswith(("fanrun._tracking", "fanrun._launch", "fanrun.backends"))
    }
    assert caller_side == set()


# Every module under fanrun/_rank, loaded as a rank loads it (by path) and as the caller's side
# imports it, with the packages a user's environment may lack made unimportable.
RANK_PACKAGE_ALONE = """
import importlib, pathlib, runpy, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "mlflow", "cloudpickle", "numpy"):
            raise ImportError(f"{name} is not importable here")

sys.meta_path.insert(0, Refuse())
import fanrun._rank
folder = pathlib.Path(fanrun._rank.__file__).parent
for path in sorted(folder.glob("*.py")):
    runpy.run_path(str(path))
    importlib.import_module(f"fanrun._rank.{path.stem}")
print(" ".join(sorted(path.stem for path in folder.glob("*.py"))))
"""


def test_the_rank_package_loads_with_torch_mlflow_and_cloudpickle_unimportable():
    done = subprocess.run([sys.executable, "-c", RANK_PACKAGE_ALONE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["__init__", "contract", "keep", "metric_sender", "panel_feed", "result_file", "spare",
                                   "tracking", "tracking_off", "worker"]
    loaded = modules_after("import fanrun._rank.worker, fanrun._rank.tracking, fanrun._rank.result_file")
    assert {m for m in loaded if m.split(".")[0] in ("torch", "mlflow", "cloudpickle", "numpy")} == set()


def test_the_call_machinery_loads_when_first_named():
    loaded = modules_after("from fanrun import distributed, TorchDistributor, FanrunError")
    assert {"fanrun._decorator", "fanrun._launch.run", "fanrun.backends.local", "fanrun._torch_distributor"} <= loaded


def test_every_exception_is_public_and_made_to_happen_by_a_test():
    """Each of fanrun's exceptions can be caught by its public name, from fanrun or fanrun.data,
    and some test makes it happen and checks it by that name."""
    import inspect
    from pathlib import Path

    import fanrun
    import fanrun.data
    from fanrun import _errors

    tests = "".join(p.read_text() for p in Path(__file__).parent.rglob("test_*.py") if p.name != Path(__file__).name)
    for name, value in vars(_errors).items():
        if not (inspect.isclass(value) and issubclass(value, BaseException)) or name.startswith("_"):
            continue
        assert getattr(fanrun, name, None) is value or getattr(fanrun.data, name, None) is value, f"{name} is not public"
        if name in ("FanrunError", "RemoteTraceback", "EngineError"):
            # The base class; the carrier of a rank's traceback, checked with the others; and an
            # invariant of the engine that did not hold, which only a fault of fanrun's raises.
            continue
        assert name in tests, f"no test makes {name} happen"


# docs/layout.md's table "What may import what": for each folder, the modules it never imports,
# anywhere in a file; a rank's files also import no third-party package at their top.
SRC = Path(__file__).resolve().parents[1] / "src" / "fanrun"
NEVER = {
    "_rank": ("fanrun",),
    "data": ("fanrun._launch", "fanrun._tracking", "fanrun.backends", "fanrun._decorator", "fanrun._detached"),
    "backends": ("fanrun._launch.run", "fanrun._tracking", "fanrun._decorator", "fanrun._detached"),
    "_launch": ("fanrun._tracking", "fanrun._decorator", "fanrun._detached"),
    "_tracking": ("fanrun._launch.run", "fanrun.backends", "fanrun._decorator", "fanrun._detached"),
}
# The one exception: a cluster's node agent serves its ranks' metric socket with the relay's own
# code, which is a socket server that knows nothing of MLflow.
ALLOWED = {"backends": ("fanrun.backends.metric_relay",)}
# data/ imports mlflow only inside a tracked call, to log the loader's figures on its run.
NEVER_AT_THE_TOP = {"_rank": ("torch", "mlflow", "cloudpickle", "numpy"), "data": ("mlflow",)}


def imported_modules(path: Path, top_only: bool = False) -> set[str]:
    """The modules a file imports (those of its top level alone with top_only), relative
    imports resolved to fanrun's own names."""
    package = ".".join(("fanrun", *path.relative_to(SRC).parent.parts)).split(".")
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if top_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder", sorted(NEVER))
def test_each_folder_imports_only_what_the_layout_allows(folder):
    broken = {}
    for path in sorted((SRC / folder).rglob("*.py")):
        found = {name for name in imported_modules(path)
                 if name.startswith(NEVER[folder]) and not name.startswith(ALLOWED.get(folder, ("-",)))}
        found |= {name for name in imported_modules(path, top_only=True) if name.startswith(NEVER_AT_THE_TOP.get(folder, ()))}
        if found:
            broken[str(path.relative_to(SRC))] = sorted(found)
    assert broken == {}


def test_ray_is_imported_by_the_ray_backend_alone_and_only_when_a_call_uses_it():
    def ray_names(names: set[str]) -> set[str]:
        return {name for name in names if name == "ray" or name.startswith("ray.")}

    broken = {}
    for path in sorted(SRC.rglob("*.py")):
        inside = path.is_relative_to(SRC / "backends" / "ray")
        found = ray_names(imported_modules(path, top_only=inside))
        if found:
            broken[str(path.relative_to(SRC))] = sorted(found)
    assert broken == {}
