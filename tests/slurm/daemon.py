"""One daemon of the local Slurm cluster, held through a pidfd: a signal can never reach a process
that took its pid over, and its end can be waited for whether or not it is this process's child
(munged daemonizes itself; slurmctld and slurmd run in the foreground)."""

from __future__ import annotations

import os
import select
import signal
import subprocess

# Slurm's daemons save their state and end within a second of SIGTERM; this is ample.
STOP_GRACE_S = 30.0


class Daemon:
    def __init__(self, name: str, pid: int, process: subprocess.Popen | None = None) -> None:
        self.name = name
        self.pid = pid
        self._process = process
        self.pidfd = os.pidfd_open(pid)

    def exited(self) -> bool:
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def stop(self) -> None:
        """SIGTERM, SIGKILL after STOP_GRACE_S, and the process reaped where it is this one's child."""
        for signo, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            if self.exited():
                break
            signal.pidfd_send_signal(self.pidfd, signo)
            if select.select([self.pidfd], [], [], wait_s)[0]:
                break
        if self._process is not None:
            self._process.wait()
        os.close(self.pidfd)

