"""MetricLink: the caller's end of a cluster call's metrics. It joins the call's MLflow socket as a
rank on one machine does (_rank/tracking.py), so the tracking side serves a cluster call
unchanged: the answer it gives (the run) goes to every node's agent, whose ranks ask their own
agent for it, and what those ranks log comes back with the nodes' events and is sent on here."""

from __future__ import annotations

import json
import pickle
import socket
import threading
from collections.abc import Callable

from .._rank.metric_sender import VALUES_PER_MESSAGE
from .._rank.tracking import MAX_ANSWER


class MetricLink:
    def __init__(self, path: str, on_answer: Callable[[dict], None]) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket.connect(path)
        self._on_answer = on_answer
        self._reader = threading.Thread(target=self._read_answer, name="fanrun-metric-link", daemon=True)
        self._reader.start()

    def forward(self, records: list[tuple]) -> None:
        """Sends what a node's ranks logged, in messages of the size a rank sends."""
        for start in range(0, len(records), VALUES_PER_MESSAGE):
            self._socket.send(pickle.dumps(records[start : start + VALUES_PER_MESSAGE], pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        """After the last forward: the relay reads what was sent, then sees the end."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the reader still waiting for an answer
        except OSError:
            pass
        self._reader.join()
        self._socket.close()

    def _read_answer(self) -> None:
        try:
            answer = self._socket.recv(MAX_ANSWER)
        except OSError:
            return
        if answer:
            self._on_answer(json.loads(answer))
