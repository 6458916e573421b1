"""Writes the ranks' output to the caller's sys.stdout / sys.stderr, labelled by rank.

sys.stdout is looked up at every write: in Jupyter it is the cell's stream, not fd 1.
A line redrawn with '\\r' (a progress bar) is redrawn in place, and closed with a newline
when another rank writes in between.
"""

from __future__ import annotations

import collections
import sys

from . import _core

TAIL_LINES = 40


class OutputMux:
    def __init__(self, world_size: int) -> None:
        self._prefixes = [f"[rank{r}]: " for r in range(world_size)]
        self._open_progress: dict[int, int | None] = {1: None, 2: None}  # stream -> rank
        self.stderr_tails = [collections.deque(maxlen=TAIL_LINES) for _ in range(world_size)]
        self._capturing: dict[int, list[str]] | None = None

    def capture_stderr(self) -> dict[int, list[str]]:
        """From now on, also keep every stderr line per rank (the stacks dumped at a timeout)."""
        self._capturing = collections.defaultdict(list)
        return self._capturing

    def write(self, rank: int, stream_number: int, segment: int, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        stream = sys.stdout if stream_number == 1 else sys.stderr
        prefix = self._prefixes[rank]
        open_rank = self._open_progress[stream_number]
        if segment == _core.SEGMENT_PROGRESS:
            if open_rank == rank:
                stream.write("\r" + prefix + text)
            else:
                stream.write(("\n" if open_rank is not None else "") + prefix + text)
                self._open_progress[stream_number] = rank
            return
        if open_rank is not None:
            stream.write("\r" if open_rank == rank else "\n")
            self._open_progress[stream_number] = None
        stream.write(prefix + text + "\n")
        if stream_number == 2:
            self.stderr_tails[rank].append(text)
            if self._capturing is not None:
                self._capturing[rank].append(text)

    def flush(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        for number, stream in ((1, sys.stdout), (2, sys.stderr)):
            if self._open_progress[number] is not None:
                stream.write("\n")
                self._open_progress[number] = None
        self.flush()
