"""MetricSender: a rank's end of its metric socket (the other end, in the tracking agent, is
backends/metric_relay.py). Values gather in the rank for up to one buffering interval, as MLflow's
own asynchronous logging does, and go as one message: a logging call costs an append, and the
relay is woken about once a second per rank, not once per value.

Run as a file, like the worker: standard library only.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading

# One message carries at most this many values, so that it fits a socket's buffer whatever
# the names (MLflow allows 250 characters).
VALUES_PER_MESSAGE = 256


class MetricSender:
    """Sends on `channel`, the rank's socket to the relay, connected when the function imported mlflow."""

    def __init__(self, channel: socket.socket, interval_s: float) -> None:
        self._channel = channel
        self._interval_s = interval_s
        self._start_buffer()
        os.register_at_fork(after_in_child=self._in_forked_child)

    def _in_forked_child(self) -> None:
        # A DataLoader worker forked from the rank has neither the thread nor a usable lock, and
        # ends with os._exit, which runs no exit handler: it sends each value at once, on the
        # shared socket, whose messages arrive whole whoever sends them.
        self._interval_s = 0.0
        self._start_buffer()

    def _start_buffer(self) -> None:
        self._lock = threading.Lock()
        self._records: list[tuple] = []
        self._has_records = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, records: list[tuple]) -> None:
        with self._lock:
            self._records.extend(records)
            full = len(self._records) >= VALUES_PER_MESSAGE or self._interval_s <= 0
            if self._thread is None and not full:
                self._thread = threading.Thread(target=self._send_periodically, name="fanrun-metric-sender", daemon=True)
                self._thread.start()
        if full:
            self.flush()
        else:
            self._has_records.set()

    def close(self) -> None:
        """At the rank's exit, before its threads are stopped: ends the sending thread and sends
        the rest. A daemon thread still running when the interpreter finalizes is cut off
        with pthread_exit as it wakes, which has aborted processes that had loaded C++ code
        (torch): "terminate called without an active exception"."""
        self._closing.set()
        self._has_records.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    def flush(self) -> None:
        """Sends what has gathered."""
        with self._lock:
            records, self._records = self._records, []
            self._has_records.clear()
        for start in range(0, len(records), VALUES_PER_MESSAGE):
            self._channel.send(pickle.dumps(records[start : start + VALUES_PER_MESSAGE], pickle.HIGHEST_PROTOCOL))

    def _send_periodically(self) -> None:
        while True:
            self._has_records.wait()  # a first value since the last send
            # The values of one interval gather; close() cuts the wait short.
            if self._closing.wait(self._interval_s):
                return
            try:
                self.flush()
            except OSError:
                return  # the caller is gone: the run is over
