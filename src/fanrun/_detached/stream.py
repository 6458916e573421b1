"""A detached run's output, written once and read by anyone who attaches, live.

The runner's sys.stdout and sys.stderr are a Broadcast: each write goes to output.log and, in the
same order, to every attached reader over the run's socket (files.SOCKET, in its private
directory). A reader sends the offset it has read to, gets the log from there, then what is
written after, framed as `<stream> <length>\\n<bytes>`; the offsets are the log's.

A slow cell never slows a run: each reader has a thread of its own and a bounded queue, and a
write only appends to the queues, under a lock that no socket call is made under. A reader whose
queue is full, or whose first line is not in within FIRST_LINE_S, is dropped; it connects again
and resumes from its offset, read from the log on disk. A log that cannot be written (a full
disk) stops there, and the run goes on; `log_error` says why, for the run's final state.
"""

from __future__ import annotations

import codecs
import errno
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from .._display.terminal_text import printable
from .._launch.records import FINAL, NO_ROOM, RunRecord
from .._private_dir import open_private
from . import files

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 64 * 1024
# How long a reader may take to send its whole first line (the offset); then it is dropped.
FIRST_LINE_S = 5.0
_FIRST_LINE_BYTES = 32
# What may wait for one reader, in bytes; a reader further behind is dropped and resumes from disk.
READER_QUEUE_BYTES = 1024 * 1024
# Readers at once; one more is turned away (each has a thread).
MAX_READERS = 64
# How long the readers get, once the run has ended, to take what waits for them.
CLOSE_S = 5.0


def _socket_path(dir_fd: int) -> str:
    # Through the directory's descriptor: a run's path may be longer than a socket's address.
    return f"/proc/self/fd/{dir_fd}/{files.SOCKET}"


class _Reader:
    """One attached reader: its socket and the frames that wait for it (under Broadcast._lock)."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.frames: deque[bytes] = deque()
        self.queued = 0
        self.dropped = False


class Broadcast:
    """The runner's output: output.log, and every attached reader."""

    def __init__(self, directory: Path) -> None:
        self._dir_fd = os.open(directory, _DIRECTORY_FLAGS)
        self._log = open_private(self._dir_fd, files.OUTPUT, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._log_reader = open_private(self._dir_fd, files.OUTPUT, os.O_RDONLY)
        self._size = os.fstat(self._log).st_size
        self.log_error: str | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._readers: list[_Reader] = []
        self._connections: dict[socket.socket, threading.Thread] = {}  # every client, registered or not
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_socket_path(self._dir_fd))
        self._listener.listen()
        self._accepting = threading.Thread(target=self._accept, name="fanrun-attach", daemon=True)
        self._accepting.start()
        self.stdout, self.stderr = _Stream(self, 1), _Stream(self, 2)

    def write(self, stream: int, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            written = self._append(data)
            if not written:
                return
            frame = f"{stream} {written}\n".encode() + data[:written]
            for reader in list(self._readers):
                if reader.queued + len(frame) > READER_QUEUE_BYTES:
                    self._drop(reader)  # behind: it reconnects from its offset
                else:
                    reader.frames.append(frame)
                    reader.queued += len(frame)
            self._changed.notify_all()

    def _append(self, data: bytes) -> int:
        """Writes `data` to the log; how much of it went there (none once the log has failed)."""
        if self.log_error is not None:
            return 0
        written = 0
        with memoryview(data) as view:
            try:
                while written < len(view):
                    written += os.write(self._log, view[written:])
            except OSError as error:
                what = "disk full" if error.errno in NO_ROOM else "output.log could not be written"
                self.log_error = (f"{what}: output.log stops at {self._size + written} bytes "
                                  f"({os.strerror(error.errno)}); the output after it was not kept")
        self._size += written
        return written

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._connections) >= MAX_READERS:
                    connection.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(connection,), name="fanrun-attach-reader",
                                          daemon=True)
                self._connections[connection] = thread
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        """One reader, in a thread of its own: the log from its offset, from disk, then what is written."""
        reader = _Reader(connection)
        try:
            offset = _read_offset(connection)
            with self._lock:
                if self._closed:
                    return
                end = self._size
                self._readers.append(reader)
            while offset < end:
                data = os.pread(self._log_reader, min(_CHUNK, end - offset), offset)
                if not data:
                    break
                connection.sendall(f"1 {len(data)}\n".encode() + data)
                offset += len(data)
            while True:
                with self._lock:
                    while not reader.frames and not reader.dropped and not self._closed:
                        self._changed.wait()
                    if reader.dropped or not reader.frames:
                        return  # dropped, or the run has ended and it has had everything
                    frames = b"".join(reader.frames)
                    reader.frames.clear()
                    reader.queued = 0
                connection.sendall(frames)
        except (OSError, ValueError):
            pass  # gone, or dropped, or it never said where to start
        finally:
            with self._lock:
                if reader in self._readers:
                    self._readers.remove(reader)
                self._connections.pop(connection, None)
            connection.close()

    def _drop(self, reader: _Reader) -> None:
        """Under the lock: the reader's thread stops; shutdown() wakes it from a send it waits in."""
        self._readers.remove(reader)
        reader.dropped = True
        reader.frames.clear()
        _shut(reader.connection)

    def close(self) -> None:
        """After the run's final state is written: the readers get what waits for them, then
        the end of their stream. It returns within CLOSE_S, whatever the readers do."""
        try:
            os.unlink(files.SOCKET, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepting.join()
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            threads = list(self._connections.values())
        deadline = time.monotonic() + CLOSE_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            late = list(self._connections)
        for connection in late:
            _shut(connection)
        for thread in threads:
            thread.join(1.0)  # woken by the shutdown; each is a daemon, which never holds the runner up
        os.close(self._log)
        os.close(self._log_reader)
        os.close(self._dir_fd)


def _shut(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # gone already


class _Stream:
    """sys.stdout or sys.stderr of the runner: text in, bytes to the Broadcast."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, broadcast: Broadcast, number: int) -> None:
        self._broadcast = broadcast
        self._number = number

    def write(self, text: str) -> int:
        self._broadcast.write(self._number, text.encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _read_offset(connection: socket.socket) -> int:
    """The reader's first line, its offset, read against one deadline for the whole line."""
    deadline = time.monotonic() + FIRST_LINE_S
    line = b""
    while b"\n" not in line:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or len(line) > _FIRST_LINE_BYTES:
            raise ValueError("the reader did not say where to start in time")
        connection.settimeout(remaining)
        more = connection.recv(_FIRST_LINE_BYTES)
        if not more:
            raise ValueError("the reader left before it said where to start")
        line += more
    connection.settimeout(None)  # its sends block; close() wakes them
    offset = int(line.split(b"\n", 1)[0])
    if offset < 0:
        raise ValueError(f"a negative offset, {offset}")
    return offset


def _log_from(dir_fd: int, offset: int) -> Iterator[bytes]:
    """output.log from `offset` on, in chunks; nothing where there is none yet."""
    try:
        fd = open_private(dir_fd, files.OUTPUT, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        while data := os.pread(fd, _CHUNK, offset):
            yield data
            offset += len(data)
    finally:
        os.close(fd)


def follow(directory: Path, offset: int = 0, rank: int | None = None) -> int:
    """Writes the run's output from `offset` to this process's sys.stdout and sys.stderr as it
    comes, until the run has ended; returns the offset reached. With `rank`, only that rank's
    lines ("[rankN]: ...")."""
    out = _Writer(rank)
    while True:
        offset = _follow_once(directory, offset, out)
        if RunRecord(directory).state()["status"] in FINAL:
            # What was written after the reader's last frame, if the runner dropped it at the end.
            return _copy_rest(directory, offset, out)


def _follow_once(directory: Path, offset: int, out: _Writer) -> int:
    dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            reader.connect(_socket_path(dir_fd))
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ECONNREFUSED):
                return _copy_rest(directory, offset, out)  # the run is over, or its runner is gone
            raise
        reader.sendall(f"{offset}\n".encode())
        stream = reader.makefile("rb")
        while header := stream.readline():
            number, length = (int(field) for field in header.split())
            data = stream.read(length)
            if len(data) < length:
                break
            out.write(number, data)
            offset += length
        return offset
    finally:
        reader.close()
        os.close(dir_fd)


def _copy_rest(directory: Path, offset: int, out: _Writer) -> int:
    dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    try:
        for data in _log_from(dir_fd, offset):
            out.write(1, data)
            offset += len(data)
    finally:
        os.close(dir_fd)
    out.finish()
    return offset


class _Writer:
    """Text to this process's streams, decoded across frame boundaries, without control
    sequences (_display/terminal_text.py); one rank's lines alone where a rank is given."""

    def __init__(self, rank: int | None) -> None:
        self._decoders = {number: codecs.getincrementaldecoder("utf-8")("replace") for number in (1, 2)}
        self._label = None if rank is None else f"[rank{rank}]: "
        self._partial = {1: "", 2: ""}

    def write(self, number: int, data: bytes) -> None:
        text = self._decoders[number].decode(data)
        if self._label is not None:
            lines = (self._partial[number] + text).split("\n")
            self._partial[number] = lines.pop()
            text = "".join(f"{line[len(self._label):]}\n" for line in lines if line.startswith(self._label))
        text = printable(text)  # a rank's escape sequences never reach this terminal
        if text:
            stream = sys.stdout if number == 1 else sys.stderr
            stream.write(text)
            stream.flush()

    def finish(self) -> None:
        for number in (1, 2):
            self.write(number, b"")
