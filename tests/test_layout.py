"""The layers keep to their side: what runs inside a rank loads none of the caller's machinery."""

from __future__ import annotations

import ast
import re
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
    assert done.stdout.split() == ["__init__", "abandon", "after_import", "call_store", "contract", "group_release", "keep",
                                   "metric_sender", "panel_feed", "progress", "result_file", "spare", "tracking",
                                   "tracking_off", "worker", "zygote"]
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


# docs/layout.md's table "What may import what", from every file's imports (TYPE_CHECKING's and
# those inside functions included): for each folder, the parts of fanrun it never imports.
SRC = Path(__file__).resolve().parents[1] / "src" / "fanrun"
FACE = ("fanrun._decorator", "fanrun._torch_distributor", "fanrun._warmup")
NEVER = {
    "_rank": ("fanrun",),
    "data": ("fanrun._launch", "fanrun._tracking", "fanrun.backends", "fanrun._display", "fanrun._detached",
             "fanrun._spec", "fanrun._cli", *FACE),
    "_spec": ("fanrun._launch", "fanrun._tracking", "fanrun.backends", "fanrun._display", "fanrun._detached",
              "fanrun._cli", "fanrun.data", *FACE),
    "backends": ("fanrun._launch", "fanrun._tracking", "fanrun._display", "fanrun._detached", "fanrun._cli",
                 "fanrun.data", *FACE),
    "_display": ("fanrun._launch", "fanrun._tracking", "fanrun.backends", "fanrun._detached", "fanrun._cli",
                 "fanrun.data", *FACE),
    "_tracking": ("fanrun._launch", "fanrun._display", "fanrun._detached", "fanrun._cli", "fanrun.data", *FACE),
    "_health": ("fanrun._launch", "fanrun._tracking", "fanrun._display", "fanrun._detached", "fanrun._cli",
                "fanrun.data", *FACE),
    "_launch": ("fanrun._detached", "fanrun._cli", "fanrun.data", *FACE),
    "_detached": ("fanrun._cli", *FACE),
}
# What a folder may import although a rule above names it: the rank contract, which every side
# shares; tracking's one hook into the call path.
ALLOWED = {"data": ("fanrun._rank",), "_spec": ("fanrun._rank",), "backends": ("fanrun._rank",),
           "_display": ("fanrun._rank",)}
# data/ imports mlflow only inside a tracked call, to log the loader's figures on its run.
NEVER_AT_THE_TOP = {"_rank": ("torch", "mlflow", "cloudpickle", "numpy"), "data": ("mlflow",)}


def module_name(path: Path) -> str:
    return ".".join(("fanrun", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")


def imported_modules(path: Path, top_only: bool = False) -> set[str]:
    """The modules a file imports (those of its top level alone with top_only), relative
    imports resolved to fanrun's own names."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
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


def fanrun_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of fanrun's that a file imports: `from . import x` names module x, `from .x
    import name` module x, and a package only where a name of its own is imported from it."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in SRC.rglob("*.py")}
    modules = set(files) | {"fanrun._core"}
    return {name: fanrun_imports(path, modules) - {name} for name, path in files.items()}


def test_no_import_cycle_among_fanruns_modules():
    """Not through a function-level import either: each module's imports, lazy ones included,
    lead only downwards."""
    graph = import_graph()
    cycles, state = [], {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph.get(name, ())):
            if state.get(imported) == "open":
                cycles.append(" -> ".join(trail[trail.index(imported):] + [name, imported]) if imported in trail
                              else f"{name} -> {imported}")
            elif imported not in state:
                visit(imported, trail + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_the_graph_sees_lazy_imports():
    """The test above can fail: the decorator's detach=True imports _detached inside a function."""
    assert "fanrun._detached.run" in import_graph()["fanrun._decorator"]


@pytest.mark.parametrize("folder", sorted(NEVER))
def test_each_folder_imports_only_what_the_layout_allows(folder):
    broken = {}
    for path in sorted((SRC / folder).rglob("*.py")):
        found = {name for name in imported_modules(path)
                 if name.startswith(NEVER[folder]) and not name.startswith(ALLOWED.get(folder, ("-",)))
                 and name.startswith("fanrun")}
        found |= {name for name in imported_modules(path, top_only=True) if name.startswith(NEVER_AT_THE_TOP.get(folder, ()))}
        if found:
            broken[str(path.relative_to(SRC))] = sorted(found)
    assert broken == {}


def test_only_the_call_path_starts_ranks():
    """Every door goes through _launch/call.py: it alone runs an attempt (_launch/run.py), and
    run.py alone asks a backend to start ranks (backends.for_plan)."""
    graph = import_graph()
    assert {name for name, imported in graph.items() if "fanrun._launch.run" in imported} == {"fanrun._launch.call"}
    asking = {str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
              if any(isinstance(node, ast.Attribute) and node.attr == "for_plan" for node in ast.walk(ast.parse(path.read_text())))}
    assert asking == {"_launch/run.py"}
    doors = ["_decorator.py", "_torch_distributor.py", "_cli/run.py", "_detached/runner.py", "_detached/ray_driver.py"]
    for door in doors:
        assert "fanrun._launch.call" in graph[module_name(SRC / door)], door


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


def test_docs_layout_names_every_module_and_nothing_that_is_gone():
    """docs/layout.md's tree matches the source: each module of fanrun's is named there (as its
    file's name, or its folder's path with it), and each file it names exists."""
    page = (SRC.parents[1] / "docs" / "layout.md").read_text()
    tree = page.split("```", 2)[1]
    named = set(re.findall(r"[A-Za-z0-9_/]+\.(?:py|sh|cc|h)\b", tree))
    files = [path.relative_to(SRC) for path in SRC.rglob("*.py") if path.name not in ("__init__.py", "__main__.py")]
    unnamed = [str(path) for path in files if path.name not in {name.rsplit("/", 1)[-1] for name in named}]
    assert unnamed == []
    repository = SRC.parents[1]
    every = {path.name for root in ("src", "cpp", "packaging") for path in (repository / root).rglob("*")}
    gone = sorted(name for name in named if name.rsplit("/", 1)[-1] not in every)
    assert gone == []
