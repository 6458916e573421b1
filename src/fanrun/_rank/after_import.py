"""A meta path finder that calls back once a module's first import has run: how a rank patches
torch only if and when the function imports it. Run as a file by the rank's modules, like the
worker itself: standard library only."""

from __future__ import annotations

import importlib.util
import sys


class AfterImport:
    """Calls `after()` once the first import of module `name` has run."""

    def __init__(self, name: str, after) -> None:
        self.name = name
        self.after = after

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once only, and the real finders must not meet it again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, after = spec.loader.exec_module, self.after

        def exec_then_call_back(module) -> None:
            exec_module(module)
            after()

        spec.loader.exec_module = exec_then_call_back
        return spec


def call_after_import(name: str, after) -> None:
    """after() now if `name` is imported already, else once it is; at most one waiting hook per callback."""
    if name in sys.modules:
        after()
    elif not any(isinstance(finder, AfterImport) and finder.after is after for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(name, after))
