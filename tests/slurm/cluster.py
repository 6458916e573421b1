"""A real two-node Slurm cluster on this one host, for the tests: a private munged, slurmctld, and
two slurmd (node1 and node2), every file of theirs in a folder of the cluster's own, stopped with
proof that none of their processes, nor any of their jobs', is left.

Two slurmd on one host: Debian builds Slurm with --enable-multiple-slurmd (`scontrol show config`
reads MULTIPLE_SLURMD = Yes), so `slurmd -N node1` serves node1 alone, and each node has a Port of
its own in slurm.conf and its own spool, pid file and log (%n): both run side by side on
127.0.0.1, where slurmctld reaches each through its port, with no namespace of its own for either.
SLURMD_NODENAME tells a task which node it runs on; both nodes' hostname is this host's.

Every process of the cluster carries MARKER_VARIABLE=<its folder> in its environment: the daemons
get it from here, and every job from its client (srun and sbatch pass their environment on), so
that whatever outlives stop() is found, however it was started."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from daemon import Daemon
from munge_daemon import MungeFiles, start_munged, write_munge_key
from processes import processes_with_environment, wait_gone
from slurm_conf import NODES, write_slurm_conf

MARKER_VARIABLE = "FANRUN_TEST_SLURM"
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "sinfo", "scontrol",
                  "srun", "sbatch", "salloc", "squeue", "scancel")
# The daemons live in /usr/sbin, which a user's PATH may lack.
SEARCH_PATH = os.pathsep.join(filter(None, [os.environ.get("PATH"), "/usr/sbin", "/sbin"]))
START_DEADLINE_S = 60.0
POLL_PAUSE_S = 0.2
# A job's processes end within moments of its last step; what is still there after this is left.
JOB_END_GRACE_S = 10.0
CLIENT_TIMEOUT_S = 120.0


class ClusterDidNotStart(RuntimeError):
    pass


def missing_binaries() -> list[str]:
    return [name for name in SLURM_BINARIES if shutil.which(name, path=SEARCH_PATH) is None]


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone


class LocalSlurm:
    def __init__(self, directory: Path) -> None:
        """`directory`: new, empty, and reachable by every user through its parents: munged
        refuses a socket that some client could not reach."""
        self.directory = directory
        self.nodes = NODES
        self.munge = MungeFiles(directory / "munge")
        self.conf = directory / "slurm.conf"
        self.logs = [self.munge.log, directory / "slurmctld.log", directory / "slurmctld.out",
                     *(directory / f"slurmd-{node}{suffix}" for node in NODES for suffix in (".log", ".out"))]
        self.marker = f"{MARKER_VARIABLE}={directory}"
        # A folder the last node does not share with this machine: its slurmd, and every task it
        # starts, sees an empty file system of its own there (a mount namespace of its own).
        self.unshared = directory / "unshared"
        self.env = self._client_environment()
        self._daemons: list[Daemon] = []

    def _client_environment(self) -> dict[str, str]:
        # A test run inside a Slurm job must not steer these clients to that job or its cluster.
        env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.conf), PATH=SEARCH_PATH, **{MARKER_VARIABLE: str(self.directory)})
        return env

    def start(self) -> None:
        """Returns once both nodes are idle and a batch job would start at once; raises
        ClusterDidNotStart with the daemons' logs, every process it started stopped."""
        try:
            self._write_files()
            self._daemons.append(start_munged(self.munge, self.env))
            self._start_in_foreground("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
            # The nodes start once the controller answers: a slurmd that finds none retries its
            # registration only seconds later.
            self._wait_until(lambda: self.run(["scontrol", "ping"]).returncode == 0, "slurmctld answering")
            for node in NODES[:-1]:
                self._start_in_foreground(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(self.conf))
            self.unshared.mkdir()
            # unshare execs sh, which execs slurmd: the daemon's pid is the one started here.
            self._start_in_foreground(f"slurmd-{NODES[-1]}", "unshare", "--mount", "--propagation", "private", "sh",
                                      "-c", 'mount -t tmpfs fanrun-unshared "$0" && exec "$@"', str(self.unshared),
                                      "slurmd", "-D", "-N", NODES[-1], "-f", str(self.conf))
            self._wait_until(lambda: self.node_states() == {node: "idle" for node in NODES}, "both nodes idle")
            # Until its first pass, some seconds after it starts, slurmctld's scheduler leaves a
            # batch job pending even on idle nodes (srun and salloc are allocated at once).
            self._wait_until(self._scheduler_has_run, "a first pass of slurmctld's scheduler")
        except Exception as error:
            logs = self.log_tails()
            left = self.stop()
            killed = f"; these outlived the daemons and were killed: {left}" if left else ""
            raise ClusterDidNotStart(f"{error}{killed}\n{logs}") from error

    def _write_files(self) -> None:
        # Execute for all: munged checks that any client can reach its socket; nothing is listed.
        self.directory.chmod(0o711)
        self.munge.directory.mkdir(mode=0o711)
        write_munge_key(self.munge.key)
        write_slurm_conf(self.directory, socket.gethostname(), self.munge.socket)

    def _start_in_foreground(self, name: str, *command: str) -> None:
        with open(self.directory / f"{name}.out", "wb") as output:
            # A session of its own: a Ctrl+C at the terminal reaches pytest, which stops the
            # daemons in order, the nodes before the controller and munged.
            process = subprocess.Popen(command, env=self.env, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self._daemons.append(Daemon(name, process.pid, process))

    def _wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Slurm's daemons tell no one when they are ready (Slurm 22.05 has no sd_notify; Debian
        runs them as Type=simple), so the clients ask, a short pause apart, up to a deadline. The
        pause is a wait on the daemons' pidfds: it ends at once if one of them exits."""
        deadline = time.monotonic() + START_DEADLINE_S
        while not ready():
            ended = [daemon.name for daemon in self._daemons if daemon.exited()]
            if ended:
                raise RuntimeError(f"{', '.join(ended)} exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {START_DEADLINE_S:g} s: {self.node_states()}")
            select.select([daemon.pidfd for daemon in self._daemons], [], [], POLL_PAUSE_S)

    def as_the_last_node_sees(self, path: Path) -> Path:
        """`path` under the cluster's unshared folder as the last node, in its mount namespace of
        its own, sees it: written there, the last node finds it, and this machine does not."""
        assert path.is_relative_to(self.unshared), path
        slurmd = next(daemon for daemon in self._daemons if daemon.name == f"slurmd-{NODES[-1]}")
        return Path(f"/proc/{slurmd.pid}/root") / path.relative_to("/")

    def node_states(self) -> dict[str, str]:
        shown = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"])
        return dict(line.split() for line in shown.stdout.splitlines()) if shown.returncode == 0 else {}

    def _scheduler_has_run(self) -> bool:
        shown = self.run(["sdiag"])
        cycles = re.search(r"Main schedule statistics.*?Total cycles:\s*(\d+)", shown.stdout, re.DOTALL)
        return cycles is not None and int(cycles.group(1)) > 0

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Runs a client (srun, sbatch, salloc, scontrol, scancel...) against this cluster."""
        return subprocess.run(command, env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              timeout=kwargs.pop("timeout", CLIENT_TIMEOUT_S), **kwargs)

    def processes(self) -> list[tuple[int, str]]:
        """Live processes of this cluster: its daemons, and every process of its jobs."""
        return processes_with_environment(self.marker.encode())

    def job_processes(self) -> list[tuple[int, str]]:
        """Live processes of this cluster's jobs: slurmstepd, batch scripts, tasks. A daemon's
        own children (slurmctld's slurmscriptd) are not: a job's slurmstepd daemonizes, so neither
        it nor anything under it is a daemon's child."""
        daemons = {daemon.pid for daemon in self._daemons}
        return [(pid, command) for pid, command in self.processes()
                if pid not in daemons and parent_of(pid) not in daemons]

    def stop(self) -> list[tuple[int, str]]:
        """Stops the daemons, nodes first and munged last; returns the processes that outlived
        them (a job's, such as a slurmstepd, which outlives its slurmd by design), killed now."""
        for daemon in reversed(self._daemons):
            daemon.stop()
        self._daemons = []
        left = self.processes()
        still = set(wait_gone([pid for pid, _ in left], JOB_END_GRACE_S))
        for pid in still:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(list(still), JOB_END_GRACE_S)
        return [found for found in left if found[0] in still]

    def log_tails(self, lines: int = 30) -> str:
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else "(none)\n"
            parts.append(f"--- {log.name}:\n" + "".join(text.splitlines(keepends=True)[-lines:]))
        return "".join(parts)
