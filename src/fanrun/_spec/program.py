"""What every rank of a call runs: fanrun's worker in one of its modes, or a native program."""

from __future__ import annotations

import dataclasses
import sys

from .._rank.worker import bootstrap_code


@dataclasses.dataclass
class RankProgram:
    """What every rank runs: fanrun's worker in a mode, or a native program."""

    argv: list[str]
    python: bool

    @classmethod
    def function(cls) -> RankProgram:
        return cls([sys.executable, "-u", "-c", bootstrap_code(), "function"], True)

    @classmethod
    def script(cls, path: str, args: list[str], module: bool = False) -> RankProgram:
        mode = "module" if module else "script"
        return cls([sys.executable, "-u", "-c", bootstrap_code(), mode, path, *args], True)

    @classmethod
    def native(cls, argv: list[str]) -> RankProgram:
        return cls(list(argv), False)

    @property
    def is_function(self) -> bool:
        """The ranks call a Python function (the decorator's door), rather than run a program."""
        return self.python and self.argv[4:5] == ["function"]
