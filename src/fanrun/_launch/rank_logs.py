"""A run's output as a blocking call shows it, read back from its ranks' logs in the run
directories its record names: every line labelled by its rank ("[rank1]: ..."), each attempt's
after the one before; or one rank's lines alone, as they are in its log. Read whole (`fanrun
logs`), or followed as the ranks write them until the run ends (`fanrun attach`), woken by
inotify as the logs and the record change."""

from __future__ import annotations

import codecs
import os
import re
import sys
from pathlib import Path

from .._display.terminal_text import printable
from .._private_dir import open_private
from .._file_changes import FileChanges
from .record_files import FINAL
from .record_watch import ProcessEnd
from .records import RunRecord

_LOG = re.compile(r"rank_(\d+)\.log")
_CHUNK = 64 * 1024


class _Log:
    """One rank's log of one attempt: how far it has been read, and the line it ended in."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.offset = 0
        self.partial = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")


class _Attempt:
    """One attempt's run directory and its rank logs, read from where they were left."""

    def __init__(self, directory: Path, dir_fd: int) -> None:
        self.directory = directory
        self.dir_fd = dir_fd
        self.logs: dict[int, _Log] = {}

    def read(self, only_rank: int | None, final: bool) -> str:
        """What the ranks wrote since the last read, as whole lines (and, `final`, the lines they
        left unended)."""
        for name in os.listdir(self.dir_fd):
            matched = _LOG.fullmatch(name)
            if matched and int(matched.group(1)) not in self.logs:
                self.logs[int(matched.group(1))] = _Log(int(matched.group(1)))
        shown = []
        for rank in sorted(self.logs):
            if only_rank is not None and rank != only_rank:
                continue
            log = self.logs[rank]
            text = log.partial + log.decoder.decode(self._more(log), final)
            lines = text.split("\n")
            log.partial = "" if final else lines.pop()
            if final and lines and lines[-1] == "":
                lines.pop()
            label = "" if only_rank is not None else f"[rank{rank}]: "
            shown.extend(f"{label}{line}\n" for line in lines)
        return "".join(shown)

    def _more(self, log: _Log) -> bytes:
        try:
            fd = open_private(self.dir_fd, f"rank_{log.rank}.log", os.O_RDONLY)  # never a link in a log's place
        except (FileNotFoundError, OSError):
            return b""
        try:
            chunks = []
            while data := os.pread(fd, _CHUNK, log.offset):
                chunks.append(data)
                log.offset += len(data)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def close(self) -> None:
        os.close(self.dir_fd)


class _Attempts:
    """The run directories of a record, in order, opened as the record names them."""

    def __init__(self, record: RunRecord) -> None:
        self._record = record
        self.opened: dict[str, _Attempt] = {}

    def update(self, state: dict, changes: FileChanges | None = None) -> list[_Attempt]:
        for path in state.get("run_dirs") or ([state["run_dir"]] if state.get("run_dir") else []):
            if path in self.opened:
                continue
            found = self._record.run_directory(path)
            if found is None:
                continue  # pruned, or not a run directory of the runs root: nothing of it is read
            self.opened[path] = _Attempt(*found)
            if changes is not None:
                changes.watch(f"/proc/self/fd/{found[1]}", directory=True)
        return list(self.opened.values())

    def close(self) -> None:
        for attempt in self.opened.values():
            attempt.close()


def read(record: RunRecord, rank: int | None = None) -> str:
    """The run's output so far: every rank's lines labelled, attempt after attempt; with `rank`,
    that rank's lines alone."""
    attempts = _Attempts(record)
    try:
        found = attempts.update(record.state())
        return "".join(_headed(attempt, index, rank) + attempt.read(rank, final=True)
                       for index, attempt in enumerate(found))
    finally:
        attempts.close()


def follow(record: RunRecord, rank: int | None = None) -> None:
    """Writes the run's output to this process's sys.stdout from its start, as the ranks write
    it, until the run has ended. It waits on the record's and the logs' changes, and on the
    runner's end, never on a clock."""
    attempts = _Attempts(record)
    written: set[str] = set()
    try:
        with FileChanges([], directories=[str(record.directory)]) as changes, ProcessEnd() as runner_end:
            while True:
                state = record.state()
                ended = state["status"] in FINAL
                found = attempts.update(state, changes)
                for index, attempt in enumerate(found):
                    if str(attempt.directory) not in written:
                        written.add(str(attempt.directory))
                        _write(_headed(attempt, index, rank))
                    _write(attempt.read(rank, final=ended))
                if ended:
                    return
                runner = record.read_runner()
                if runner is not None and not runner_end.follow(runner["pid"], runner["start"]):
                    continue  # it ended just now: the next read marks the run
                changes.wait(None, also=runner_end.fds)
    finally:
        attempts.close()


def _headed(attempt: _Attempt, index: int, rank: int | None) -> str:
    """A line before the output of each attempt after the first (max_restarts)."""
    return f"fanrun: attempt {index + 1}, in {attempt.directory}\n" if index > 0 and rank is None else ""


def _write(text: str) -> None:
    text = printable(text)  # a rank's escape sequences never reach this terminal
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
