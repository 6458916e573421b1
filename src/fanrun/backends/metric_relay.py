"""MetricRelay: the tracking side's end of the ranks' MLflow sockets, served from one thread of the
agent (agent.py). It tells each rank that connects which run the call logs to, and
receives the values every rank logs on that run and writes them to the tracking store in
batches, so that the ranks' loops never wait on the store.

The socket exists before any rank starts (the caller makes it, RelaySocket); the run may not
yet. A rank connects when its function imports mlflow, and its first message is the answer,
sent as soon as publish() gives it: the run's identity, or "not tracked".

A rank then sends one message per logging call (_rank/tracking.py): a pickled list of
(key, value, timestamp, step, model_id, dataset_name, dataset_digest), the metrics, and
("param" | "tag", rank, key, value), its params and tags, which are kept in `keyed` for the run's close (rank_values.py) rather than written. Messages are read as
they come, so that no rank waits on a full socket, and written at most once per
WRITE_INTERVAL_S: MLflow's stores pay per request as much as per value (a local sqlite store
costs about 0.8 ms per value in batches of ten, 0.2 ms in batches of a thousand), and on a
machine whose cores the ranks fill, that time is taken from them.
"""

from __future__ import annotations

import json
import os
import pickle
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable

# MLflow's own limit of metrics per log_batch request; this many waiting are written at once.
MAX_BATCH = 1000
# The longest a value waits in the caller before it is written: what a live view of the run lags.
WRITE_INTERVAL_S = 1.0
# Larger than any message a rank sends (256 values, names of at most 250 characters).
MAX_MESSAGE = 1 << 20
# An AF_UNIX path holds at most 107 bytes on Linux.
_MAX_SOCKET_PATH = 107
# What wakes the relay's thread: an answer to give the ranks, or the end of the call.
_PUBLISH, _STOP = b"p", b"x"

Record = tuple  # (key, value, timestamp, step, model_id, dataset_name, dataset_digest)
# A param's or tag's record: ("param" | "tag", rank, key, value).
KEYED_RECORD_LENGTH = 4


class RelaySocket:
    """The ranks' socket, listening in a private temporary folder (mode 0700: only our user
    connects). Made by the caller before any rank starts; served by whoever holds `listener`."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="fanrun-mlflow-")
        self.path = os.path.join(self.folder, "socket")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if len(self.path.encode()) > _MAX_SOCKET_PATH:
                raise OSError(f"the socket path {self.path} is longer than {_MAX_SOCKET_PATH} bytes (TMPDIR is too deep)")
            self.listener.bind(self.path)
            self.listener.listen(64)
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class MetricRelay:
    """Serves `listener` (a RelaySocket's own if none is given) until stop(); `path` goes to the ranks.
    With keep_keyed=False (a cluster node's relay, whose `write` forwards to the caller's), the
    params' and tags' records are passed to `write` with the metrics, in the order they came."""

    def __init__(self, write: Callable[[list[Record]], None], listener: socket.socket | None = None,
                 keep_keyed: bool = True) -> None:
        self._write = write
        self._keep_keyed = keep_keyed
        self._own = RelaySocket() if listener is None else None
        self._listener = self._own.listener if self._own is not None else listener
        self.path = self._own.path if self._own is not None else self._listener.getsockname()
        self._listener.setblocking(False)
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._buffer = bytearray(MAX_MESSAGE)
        self._thread = threading.Thread(target=self._serve, name="fanrun-metric-relay", daemon=True)
        self.written = 0
        self.dropped = 0
        self.error: BaseException | None = None  # the store's first failure; later values are dropped
        self.keyed: list[tuple] = []  # ("param" | "tag", rank, key, value), in the order received
        self._answer: bytes | None = None
        self._unanswered: list[socket.socket] = []

    def start(self) -> None:
        self._thread.start()

    def publish(self, answer: dict) -> None:
        """What every rank that connects, or has connected, is told (once): the run's identity,
        or that the call is not tracked."""
        if self._answer is None and self._wake_write >= 0:
            self._answer = json.dumps(answer).encode()
            os.write(self._wake_write, _PUBLISH)

    def stop(self, timeout: float) -> bool:
        """Once every rank has ended: writes what is still buffered, then closes. False when the
        store did not take it within `timeout` (the thread is left to finish or fail alone)."""
        if self._wake_write >= 0:
            os.write(self._wake_write, _STOP)
            self._thread.join(timeout)
            # The thread closes the rest itself when it ends, now or after a late write.
            os.close(self._wake_write)
            self._wake_write = -1
        return not self._thread.is_alive()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_read, selectors.EVENT_READ)
        pending: list[Record] = []
        due = None  # when the oldest pending value must be written
        try:
            while True:
                stopping = False
                timeout = None if due is None else max(0.0, due - time.monotonic())
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    elif key.fileobj == self._wake_read:
                        wakes = os.read(self._wake_read, 64)
                        if _PUBLISH in wakes:
                            for connection in self._unanswered:
                                self._answer_rank(connection)
                            self._unanswered = []
                        stopping = _STOP in wakes
                    else:
                        self._receive(selector, key.fileobj, pending)
                if stopping:
                    # The ranks have ended: what they sent is in the buffers, and nothing more comes
                    # (a process they left behind still holding a socket is not waited for).
                    self._accept(selector)
                    for connection in self._connections(selector):
                        self._receive(selector, connection, pending)
                    self._store(pending)
                    return
                if pending and due is None:
                    due = time.monotonic() + WRITE_INTERVAL_S
                if pending and (len(pending) >= MAX_BATCH or time.monotonic() >= due):
                    self._store(pending)
                    pending, due = [], None
        finally:
            for connection in self._connections(selector):
                connection.close()
            selector.close()
            os.close(self._wake_read)
            if self._own is not None:
                self._own.close()
            else:
                self._listener.close()

    def _connections(self, selector: selectors.BaseSelector) -> list[socket.socket]:
        """The ranks' sockets the selector watches (a list: the caller may unregister them)."""
        return [key.fileobj for key in selector.get_map().values()
                if isinstance(key.fileobj, socket.socket) and key.fileobj is not self._listener]

    def _accept(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except BlockingIOError:
                return
            connection.setblocking(False)
            selector.register(connection, selectors.EVENT_READ)
            if self._answer is not None:
                self._answer_rank(connection)
            else:
                self._unanswered.append(connection)

    def _answer_rank(self, connection: socket.socket) -> None:
        try:
            connection.send(self._answer)  # a few hundred bytes into an empty buffer: never blocks
        except OSError:
            pass  # the rank is gone; _receive closes its end

    def _receive(self, selector: selectors.BaseSelector, connection: socket.socket, records: list[Record]) -> None:
        """Every message waiting on one rank's socket; closes it at its end."""
        while True:
            try:
                size = connection.recv_into(self._buffer)
            except BlockingIOError:
                return
            except OSError:
                size = 0
            if size == 0:
                selector.unregister(connection)
                connection.close()
                return
            try:
                received = pickle.loads(memoryview(self._buffer)[:size])
            except Exception:
                continue  # not a rank's message (only our own user can reach the socket): ignored
            for record in received:
                (self.keyed if self._keep_keyed and len(record) == KEYED_RECORD_LENGTH else records).append(record)

    def _store(self, records: list[Record]) -> None:
        if not records:
            return
        if self.error is not None:
            self.dropped += len(records)
            return
        for start in range(0, len(records), MAX_BATCH):
            batch = records[start : start + MAX_BATCH]
            try:
                self._write(batch)
            except Exception as error:
                self.error = error
                self.dropped += len(records) - start
                return
            self.written += len(batch)
