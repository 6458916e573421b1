"""SlurmRanks: a Slurm call's ranks (node_ranks.py's NodeRanks), their news read from srun's
stdout, the caller's commands written to its stdin; and start_agents(), which starts srun and
waits for every node's agent to say hello before any rank starts."""

from __future__ import annotations

import collections
import queue
import subprocess
import sys
import threading
import time

from ..._errors import NodeEnvironmentError
from ..._spec.paths import RunPaths
from ..node_ranks import Node, NodeRanks, check_health
from ..versions import differences, installed_versions
from . import wire

# How long srun may take to get the nodes (an allocation from a login node waits in Slurm's
# queue) and the agents to say hello.
AGENT_START_S = 600.0
# srun's last lines of its own, kept for the message when a node ends without its agent's word.
STDERR_KEPT = 20
# How long srun may take to end once its agents were told to stop, and then once terminated.
SRUN_END_S = 30.0


def start_agents(argv: list[str], nodes: int, per_node: int, paths: RunPaths, wakeup_fd: int,
                 tracking: str | None) -> SlurmRanks:
    srun = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # a Ctrl+C is the launcher's to handle, not srun's
    try:
        stderr = _StderrTail(srun)
        news = _News(srun)
        hellos = news.first_of_each(nodes, "hello", srun, stderr)
        _check(hellos, paths)
        node0 = hellos[0]
        _send(srun, wire.command_line(wire.GO, (node0["address"], node0["port"])))
        started = news.first_of_each(nodes, "started", srun, stderr)
        pids = [pid for node in range(nodes) for pid in started[node]]
        described = [Node(node, hellos[node]["name"], hellos[node]["address"], hellos[node]["hostname"])
                     for node in range(nodes)]
        _announce(described, per_node)
        ranks = SlurmRanks(srun, stderr, news, described, per_node, pids, paths, wakeup_fd, tracking)
        ranks.gpu_verdicts = {node: hello["health"] for node, hello in sorted(hellos.items())}
        return ranks
    except BaseException:
        _end(srun)
        raise


class SlurmRanks(NodeRanks):
    node_id_label = "Slurm node"
    news_stop_s = SRUN_END_S

    def __init__(self, srun: subprocess.Popen, stderr: _StderrTail, news: _News, nodes: list[Node], per_node: int,
                 pids: list[int], paths: RunPaths, wakeup_fd: int, tracking: str | None) -> None:
        link = None
        if tracking is not None:
            from ..metric_link import MetricLink

            link = MetricLink(tracking, lambda answer: _send(srun, wire.command_line(wire.PUBLISH, answer)))
        super().__init__(nodes, per_node, pids, paths, wakeup_fd, link)
        self._srun = srun
        self._stderr = stderr
        self._incoming = news
        self._news_threads = [threading.Thread(target=self._follow, name="fanrun-slurm-news", daemon=True)]
        self._news_threads[0].start()

    def kill_and_reap(self) -> None:
        _send(self._srun, wire.command_line(wire.KILL))
        _end(self._srun)

    def _release(self) -> None:
        _end(self._srun)

    def _tell_others(self, command: str, stopped: int | None) -> None:
        # srun gives every agent the same stdin: one line reaches them all (a node that ended ignores it).
        if len(self._ended) < len(self._nodes):
            _send(self._srun, wire.command_line({"cancel": wire.CANCEL, "kill": wire.KILL, "gather": wire.GATHER}[command]))

    def _follow(self) -> None:
        while (news := self._incoming.get()) is not None:
            node, (kind, body) = news
            if kind == "garbled":
                # Some news of the node is lost, an end perhaps: the call cannot be trusted to end well.
                for lost in range(len(self._nodes)) if node is None else [node]:
                    self._post(("lost", lost, f"its agent's news could not be read ({body})"))
            elif kind == "stopping":
                self._post(("lost", node, f"Slurm stopped its agent and ranks with {body} (scancel, the job's time "
                                          f"limit, or the node's failure)"))
            else:
                self._post((kind, node, body))
        self._srun.wait()
        why = f"the Slurm step ended (srun exit status {self._srun.returncode}) before its agent reported"
        tail = self._stderr.text()
        for node in range(len(self._nodes)):
            self._post(("lost", node, why + (f"; srun said: {tail}" if tail else "")))


class _News:
    """The agents' lines from srun's stdout, read on a thread of its own; None once it ends. Any
    other line there is not the agents': it is shown as it came."""

    def __init__(self, srun: subprocess.Popen) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(srun.stdout,), name="fanrun-srun-stdout", daemon=True).start()

    def _read(self, stream) -> None:
        joined = wire.News()
        try:
            with stream:
                for line in stream:
                    try:
                        news = joined.read(line)
                    except wire.GarbledNews as error:
                        self._queue.put((error.node, ("garbled", str(error))))
                        continue
                    if news is None:
                        # Text, not bytes: a notebook's sys.stdout has no binary buffer.
                        sys.stdout.write(line.decode(errors="replace"))
                        sys.stdout.flush()
                    elif news[1] is not None:
                        self._queue.put(news)
        finally:
            self._queue.put(None)  # whatever ended the reading: the caller hears that the news ended

    def get(self, timeout: float | None = None):
        return self._queue.get(timeout=timeout)

    def first_of_each(self, nodes: int, kind: str, srun: subprocess.Popen, stderr: _StderrTail) -> dict[int, object]:
        """Each node's item of `kind`, the first thing every agent says at that stage."""
        found: dict[int, object] = {}
        deadline = time.monotonic() + AGENT_START_S
        while len(found) < nodes:
            try:
                news = self.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise NodeEnvironmentError(f"Slurm's nodes did not start fanrun's agents within {AGENT_START_S:g} s "
                                           f"(the allocation may still wait in the queue: squeue -u $USER)") from None
            if news is None:
                srun.wait()
                raise NodeEnvironmentError(f"srun ended (exit status {srun.returncode}) before every node's agent "
                                           f"started: {stderr.text() or 'it said nothing'}")
            node, (item_kind, body) = news
            if item_kind == "garbled":
                raise NodeEnvironmentError(f"the Slurm nodes' agents could not be heard: {body}")
            if item_kind == kind:
                found[node] = body
        return found


class _StderrTail:
    """srun's stderr, read on a thread of its own; its last lines are kept for messages."""

    def __init__(self, srun: subprocess.Popen) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=STDERR_KEPT)
        self._thread = threading.Thread(target=self._read, args=(srun.stderr,), name="fanrun-srun-stderr", daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        with stream:
            for line in stream:
                self._lines.append(line.decode(errors="replace").rstrip())

    def text(self) -> str:
        self._thread.join(1.0)
        return " | ".join(line for line in self._lines if line)


def _check(hellos: dict[int, dict], paths: RunPaths) -> None:
    """Every node sees the run directory, runs the caller's versions and has healthy GPUs; else no
    rank starts."""
    for node, hello in sorted(hellos.items()):
        where = f"node {node} ({hello['name']}, host {hello['hostname']})"
        if not hello["sees_run_dir"]:
            raise NodeEnvironmentError(
                f"the call's run directory {paths.directory} is not on storage that {where} shares with this "
                f"machine (or there it is not this user's alone): the function and the results go through it. Set "
                f"FANRUN_RUNS_DIR to a folder every node sees (a shared home or project file system)")
        wrong = differences(installed_versions(), hello["versions"])
        if wrong:
            raise NodeEnvironmentError(f"{where} has {', '.join(wrong)}. Every node must run the caller's versions of "
                                       f"Python, torch, cloudpickle and fanrun: install the same ones there")
    check_health({f"node {node} ({hello['name']}, host {hello['hostname']})": hello["health"]
                  for node, hello in sorted(hellos.items())},
                 "Leave an unhealthy node out of the call (slurm={'exclude': 'NAME'}, or sbatch --exclude=NAME)")


def _send(srun: subprocess.Popen, line: bytes) -> None:
    try:
        srun.stdin.write(line)
        srun.stdin.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass  # srun has ended: its end is what the caller will hear


def _end(srun: subprocess.Popen) -> None:
    """srun told to quit (agents still waiting for go) and its stdin closed, which the agents read
    as kill; then terminated if it lingers."""
    _send(srun, wire.command_line(wire.QUIT))
    try:
        srun.stdin.close()
    except OSError:
        pass
    try:
        srun.wait(SRUN_END_S)
    except subprocess.TimeoutExpired:
        srun.terminate()
        try:
            srun.wait(SRUN_END_S)
        except subprocess.TimeoutExpired:
            srun.kill()
            srun.wait()


def _announce(nodes: list[Node], per_node: int) -> None:
    """One line before the ranks' output: which ranks run on which node."""
    where = ", ".join(f"ranks {n.rank * per_node}-{(n.rank + 1) * per_node - 1} on {n.node_id} ({n.address})"
                      if per_node > 1 else f"rank {n.rank} on {n.node_id} ({n.address})" for n in nodes)
    print(f"fanrun: {len(nodes) * per_node} ranks on {len(nodes)} Slurm nodes: {where}", file=sys.stderr, flush=True)
