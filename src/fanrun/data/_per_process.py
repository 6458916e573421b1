"""What belongs to the process that made it: a DataLoader worker forked from a process that has
one gets its own, made anew, since the parent's native threads did not come along."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._value: T | None = None
        self._pid = -1

    def get(self) -> T:
        if self._pid != os.getpid():
            self._value = self._make()
            self._pid = os.getpid()
        return self._value

    def forget(self) -> None:
        """Drops this process's value (a pickled copy makes its own)."""
        self._value, self._pid = None, -1
