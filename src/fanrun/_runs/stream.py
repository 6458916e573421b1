"""A detached run's output, written once and read by anyone who attaches, live.

The runner's sys.stdout and sys.stderr are a Broadcast: each write goes to output.log and, in the
same order, to every attached reader over the run's socket (store.SOCKET, in its private
directory). A reader sends the offset it has read to, gets the log from there, then what is
written after, framed as `<stream> <length>\\n<bytes>`; the offsets are the log's. A reader that
falls behind is dropped and connects again from its offset, so a slow cell never slows a run.
"""

from __future__ import annotations

import codecs
import errno
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from . import store

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 64 * 1024
# How long a reader may take to read the log written before it came; then it is dropped.
BACKLOG_SEND_S = 5.0


def _socket_path(dir_fd: int) -> str:
    # Through the directory's descriptor: a run's path may be longer than a socket's address.
    return f"/proc/self/fd/{dir_fd}/{store.SOCKET}"


class Broadcast:
    """The runner's output: output.log, and every attached reader."""

    def __init__(self, directory: Path) -> None:
        self._dir_fd = os.open(directory, _DIRECTORY_FLAGS)
        self._log = store.open_private(self._dir_fd, store.OUTPUT, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._lock = threading.Lock()
        self._readers: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_socket_path(self._dir_fd))
        self._listener.listen()
        self._accepting = threading.Thread(target=self._accept, name="fanrun-attach", daemon=True)
        self._accepting.start()
        self.stdout, self.stderr = _Stream(self, 1), _Stream(self, 2)

    def write(self, stream: int, data: bytes) -> None:
        if not data:
            return
        frame = f"{stream} {len(data)}\n".encode() + data
        with self._lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self._log, view):]
            for reader in list(self._readers):
                try:
                    if reader.send(frame) == len(frame):
                        continue
                except OSError:
                    pass
                self._drop(reader)  # behind, or gone: it reconnects from its offset

    def _accept(self) -> None:
        while True:
            try:
                reader, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                reader.settimeout(BACKLOG_SEND_S)
                offset = int(_read_line(reader))
                with self._lock:
                    _send_log_from(self._dir_fd, offset, reader)
                    reader.setblocking(False)
                    self._readers.append(reader)
            except (OSError, ValueError):
                reader.close()

    def _drop(self, reader: socket.socket) -> None:
        self._readers.remove(reader)
        reader.close()

    def close(self) -> None:
        """After the run's final state is written: the readers see the end of their stream."""
        try:
            os.unlink(store.SOCKET, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepting.join()
        with self._lock:
            for reader in list(self._readers):
                self._drop(reader)
        os.close(self._log)
        os.close(self._dir_fd)


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


def _read_line(reader: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        more = reader.recv(1)
        if not more:
            raise ValueError("the reader left before it said where to start")
        line += more
    return line


def _send_log_from(dir_fd: int, offset: int, reader: socket.socket) -> None:
    for data in _log_from(dir_fd, offset):
        reader.sendall(f"1 {len(data)}\n".encode() + data)


def _log_from(dir_fd: int, offset: int) -> Iterator[bytes]:
    """output.log from `offset` on, in chunks; nothing where there is none yet."""
    try:
        fd = store.open_private(dir_fd, store.OUTPUT, os.O_RDONLY)
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
        if store.state(directory)["status"] in store.FINAL:
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
    """Text to this process's streams, decoded across frame boundaries; one rank's lines alone
    where a rank is given."""

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
        if text:
            stream = sys.stdout if number == 1 else sys.stderr
            stream.write(text)
            stream.flush()

    def finish(self) -> None:
        for number in (1, 2):
            self.write(number, b"")
