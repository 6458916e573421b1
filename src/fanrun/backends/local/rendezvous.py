"""The run's rendezvous point: a port that the caller picks and holds, on 127.0.0.1 for a run on
one machine (on node 0's address, held by node 0's agent, for a run over several).

For Python ranks, where torch is importable, the caller hosts torch's TCPStore on that
port itself, as torchrun's agent does, and the ranks join it as clients
(TORCHELASTIC_USE_AGENT_STORE): the port is held from the moment it is chosen to the end
of the run, so two runs on one machine never collide. Otherwise the port is released just
before the ranks start, for rank 0 (or the native program) to bind.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket

LOOPBACK = "127.0.0.1"


class Rendezvous:
    def __init__(self, host_store: bool, host: str = LOOPBACK) -> None:
        """`host` is the address the ranks reach: loopback, unless ranks on other machines join."""
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket: socket.socket | None = socket.socket(family, socket.SOCK_STREAM)
        self._socket.bind((host, 0))
        self._socket.listen(1024)
        self.port: int = self._socket.getsockname()[1]
        self._store = None
        if host_store and importlib.util.find_spec("torch") is not None:
            self._store = _host_store(self._socket, host, self.port)

    @property
    def hosts_store(self) -> bool:
        return self._store is not None

    def environment(self) -> dict[str, str]:
        env = {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.port)}
        if self.hosts_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        return env

    def release_port_for_ranks(self) -> None:
        """Without a hosted store, rank 0 binds the port itself: let go of it now."""
        if not self.hosts_store and self._socket is not None:
            self._socket.close()
            self._socket = None

    def close(self) -> None:
        self._store = None  # the store's server stops with its last reference
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _host_store(listener: socket.socket, host: str, port: int):
    try:
        from torch.distributed import TCPStore
    except ImportError:
        return None
    # The store takes ownership of the descriptor it is given and closes it, so it
    # gets a duplicate; the listening socket it serves stays bound all along.
    fd = os.dup(listener.fileno())
    try:
        return TCPStore(
            host,
            port,
            None,
            True,
            datetime.timedelta(minutes=30),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except Exception:
        os.close(fd)
        return None
