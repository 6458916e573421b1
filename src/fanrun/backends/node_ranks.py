"""NodeRanks: a call's ranks over several nodes, as the launcher drives them (base.py's Ranks),
whatever carries each node's news: one agent per node runs its ranks with the engine's own
supervisor (node_agent.py) and reports their events with global rank numbers. wait() merges the
nodes' news, in the order it comes, into the events of one run, and stops every other node at the
first failure or the loss of a node. The files the nodes send back at their end (results, error
envelopes, logs) are written into the caller's run directory, so the outcome reads them as it
reads a local run's. A backend's subclass posts each node's news (_post) and carries commands to
its agents (_command)."""

from __future__ import annotations

import dataclasses
import os
import queue
import select
import signal
import time

from .. import _core
from .._errors import GpuHealthError, NodeLostError
from .._rank.contract import forensics_collectives_name, progress_name
from .._spec.paths import RunPaths
from . import rank_evidence

# As within a node (the engine's supervisor): a rank killed by a signal that no supervisor sent
# (the OOM killer's SIGKILL, a SIGSEGV), seen this soon after a rank on another node failed, is
# the root cause, since its peers' collectives fail the moment its connections drop. The
# supervisors' own SIGKILL comes KILL_GRACE_S after their SIGTERM, well outside this. (A node's
# supervisor knows the SIGKILLs it sent, and waits longer: 6 s.)
PEER_FAILURE_WINDOW_S = 3.0
# How long a stall's evidence may take to come from every node: their ranks' own wait, and the
# way back.
EVIDENCE_WAIT_S = rank_evidence.WAIT_S + 10.0


def check_health(found: dict[str, list[dict]], remedy: str) -> None:
    """Each node's unhealthy GPUs (of _health/node.py's verdicts, by the node's description) as one
    GpuHealthError, before a rank starts on any node; nothing where every node is healthy."""
    lines, problems = [], []
    for where, gpus in found.items():
        for gpu in gpus:
            if not gpu["problems"]:
                continue
            reason = "; ".join(gpu["problems"])
            if gpu["index"] is None:
                lines.append(f"{where}: {reason}")
            else:
                lines.append(f"{where}: GPU {gpu['index']} ({gpu['uuid']}, {gpu['name']}) is unhealthy: {reason}")
                problems.append((gpu["index"], gpu["uuid"], reason))
    if lines:
        raise GpuHealthError("\n".join(lines) + f"\nNo rank was started on any node. {remedy}; health='off' runs "
                             f"without the check. `fanrun doctor` on the node shows its GPUs.", tuple(problems))


@dataclasses.dataclass(frozen=True)
class Node:
    rank: int  # node 0 holds ranks 0 .. per_node - 1
    node_id: str  # the cluster's own name for it (Ray's node id, Slurm's node name)
    address: str
    hostname: str

    def describe(self) -> str:
        return f"node {self.rank} ({self.address})"


class NodeRanks:
    # How the cluster names a lost node, for messages ("Ray node id", "Slurm node").
    node_id_label = "node id"
    # How long close() waits for each thread that carries news, once _release() ended the agents.
    news_stop_s = 10.0

    def __init__(self, nodes: list[Node], ranks_per_node: int, pids: list[int], paths: RunPaths,
                 wakeup_fd: int, link=None) -> None:
        self._link = link  # where the ranks' MLflow records go on to the caller's agent (metric_link.py)
        self._nodes = nodes
        self._per_node = ranks_per_node
        self._pids = pids
        self._paths = paths
        self._wakeup_fd = wakeup_fd
        self.world_size = len(nodes) * ranks_per_node
        self.stop_reason = _core.StopReason.NONE
        self.first_failed_rank = -1
        self._first_failure_at = 0.0
        self.ranks_running_at_timeout: list[int] = []
        self.failure: BaseException | None = None
        self._exits: dict[int, tuple[int, int] | None] = {}
        self._obstacles: dict[int, str] = {}
        self._ended: set[int] = set()  # nodes finished or lost
        self._timeout_reported = False
        self._closed = False
        self._news: queue.SimpleQueue = queue.SimpleQueue()
        self._news_read, self._news_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._evidence: dict[int, dict] = {}  # node -> its ranks' answers, once asked
        # node -> its GPUs' verdicts from the health gate its agent ran before the ranks started
        self.gpu_verdicts: dict[int, list[dict]] = {}
        self.failure_evidence: dict[int, float] = {}  # as each node's agent asked its ranks
        # Events taken while a stall's evidence was awaited, which the next wait() hands on.
        self._held_events: list = []

    def wait(self, max_wait_s: float = -1.0, gather_s: float = 0.0):  # each node's news as it comes
        if self._news.empty() and not self._held_events:
            select.select([self._news_read, self._wakeup_fd], [], [], None if max_wait_s < 0 else max_wait_s)
        interrupted = bool(select.select([self._wakeup_fd], [], [], 0)[0])  # the launcher drains it
        try:
            os.read(self._news_read, 1 << 16)
        except BlockingIOError:
            pass
        events, self._held_events = self._held_events, []
        while True:
            try:
                item = self._news.get_nowait()
            except queue.Empty:
                break
            self._take(item, events)
        return events, interrupted, len(self._ended) == len(self._nodes)

    def cancel(self) -> None:
        if self.stop_reason == _core.StopReason.NONE and self.failure is None:
            self.stop_reason = _core.StopReason.CANCELLED
        self._tell_others("cancel", stopped=None)

    def pid(self, rank: int) -> int:
        return self._pids[rank]

    def ask_for_evidence(self, ended) -> dict[int, rank_evidence.RankAnswer]:
        """Every node still running asked at once; their news meanwhile taken as wait() would, and
        its events held for the next wait(). The ranks of a node that gives nothing within
        EVIDENCE_WAIT_S are unasked (their records, kept here already, still count)."""
        self._evidence = {}
        asked = [node for node in range(len(self._nodes)) if node not in self._ended]
        self._tell_others("gather", stopped=None)
        deadline = time.monotonic() + EVIDENCE_WAIT_S
        while any(node not in self._evidence and node not in self._ended for node in asked):
            try:
                item = self._news.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            self._take(item, self._held_events)
        answers = {}
        for node in asked:
            if node in self._evidence:
                answers.update(self._evidence[node])
            elif node not in self._ended:
                ranks = range(node * self._per_node, (node + 1) * self._per_node)
                answers.update(rank_evidence.unasked(ranks, f"its node's agent gave no evidence within "
                                                            f"{EVIDENCE_WAIT_S:g} s"))
        return answers

    def ask_for_collectives(self, ended) -> None:
        """Each node's agent asks its own ranks, every COLLECTIVES_EVERY_S while the call is
        watched, and sends their answers with their progress records."""

    def exit_status(self, rank: int) -> tuple[int, int] | None:
        return self._exits.get(rank)

    def location(self, rank: int) -> str:
        node = self._nodes[rank // self._per_node]
        return f"pid {self.pid(rank)} on {node.describe()}"

    def stack_dump_obstacle(self, rank: int) -> str | None:
        return self._obstacles.get(rank)

    def _post(self, item: tuple) -> None:
        if self._closed:
            return
        self._news.put(item)
        try:
            os.write(self._news_write, b"n")
        except (BlockingIOError, OSError):
            pass  # full: wait() is due to read it anyway; closed: the run is over

    def _take(self, item: tuple, events: list) -> None:
        kind, node, body = item
        if node in self._ended:
            return
        if kind == "batch":
            for entry in body:
                if entry[0] == "metrics":
                    if self._link is not None:
                        self._link.forward(entry[1])
                elif entry[0] == "progress":
                    for rank, data in entry[1].items():
                        self._paths.rewrite_file(progress_name(rank), data)
                elif entry[0] == "collectives":
                    for rank, data in entry[1].items():
                        self._paths.write_file(forensics_collectives_name(rank), data)
                elif entry[0] == "evidence":
                    self._evidence[node] = entry[1]
                else:
                    self._take_events(node, entry[1], entry[2], events)
        elif kind == "ended" and "agent_error" not in body:
            self._take_ending(node, body)
        elif kind == "ended":
            self._lose(node, f"its agent failed ({body['agent_error']}) and stopped them")
        else:  # "lost": why, in words
            self._lose(node, body)

    def _lose(self, node: int, why: str) -> None:
        """A node gone, with its ranks: the root cause unless a rank failed before; the others stop."""
        self._ended.add(node)
        lost = self._nodes[node]
        ranks = list(range(node * self._per_node, (node + 1) * self._per_node))
        if self.failure is None and self.stop_reason in (_core.StopReason.NONE, _core.StopReason.CANCELLED):
            self.failure = NodeLostError(
                f"{lost.describe()} was lost mid-call ({self.node_id_label} {lost.node_id}, host {lost.hostname}): {why}. "
                f"Ranks {ranks[0]}-{ranks[-1]} ran there; the other nodes' ranks were stopped.",
                node_rank=node, node_id=lost.node_id, address=lost.address, ranks=ranks,
            )
        self._tell_others("cancel", stopped=node)

    def _take_events(self, node: int, node_events: list, obstacles: dict, events: list) -> None:
        self._obstacles.update(obstacles)
        for event in node_events:
            kind, rank = event.kind, event.rank
            if kind == _core.EventKind.RANK_EXITED:
                status = (event.exit_code, event.signal)
                self._exits[rank] = status
                # As its node's supervisor counts it: a failure, unless the run was stopping already.
                if status != (0, 0) and self.stop_reason == _core.StopReason.NONE:
                    self._first_failure(node, rank)
                if self._killed_from_outside_just_after_the_first_failure(rank, status):
                    self.first_failed_rank = rank
            elif kind == _core.EventKind.RANK_FAILED:
                self._first_failure(node, rank)
            elif kind == _core.EventKind.TIMED_OUT:
                if self._timeout_reported:
                    continue  # each node's timeout strikes; the run's is reported once
                self._timeout_reported = True
                if self.stop_reason == _core.StopReason.NONE:
                    self.stop_reason = _core.StopReason.TIMEOUT
            events.append(event)

    def _take_ending(self, node: int, ending: dict) -> None:
        self._ended.add(node)
        for name, data in ending["files"].items():
            self._paths.write_file(name, data)
        self._exits.update(ending["exits"])
        self.failure_evidence.update(ending["failure_evidence"])
        self.ranks_running_at_timeout = sorted({*self.ranks_running_at_timeout, *ending["running_at_timeout"]})
        reason = ending["stop_reason"]
        if reason == _core.StopReason.RANK_FAILED:
            self._first_failure(node, ending["first_failed_rank"])
        elif reason == _core.StopReason.TIMEOUT and self.stop_reason in (_core.StopReason.NONE, _core.StopReason.CANCELLED):
            self.stop_reason = _core.StopReason.TIMEOUT

    def _first_failure(self, node: int, rank: int) -> None:
        """The first rank to fail anywhere is the root cause; every other node is stopped now."""
        if self.failure is not None or self.stop_reason in (_core.StopReason.RANK_FAILED, _core.StopReason.TIMEOUT):
            return
        self.stop_reason = _core.StopReason.RANK_FAILED
        self.first_failed_rank = rank
        self._first_failure_at = time.monotonic()
        self._tell_others("cancel", stopped=node)

    def _killed_from_outside_just_after_the_first_failure(self, rank: int, status: tuple[int, int]) -> bool:
        signo = status[1]
        return (self.stop_reason == _core.StopReason.RANK_FAILED and self.failure is None
                and rank != self.first_failed_rank and signo not in (0, signal.SIGTERM)
                and time.monotonic() - self._first_failure_at <= PEER_FAILURE_WINDOW_S)

    def _tell_others(self, command: str, stopped: int | None) -> None:
        for node in range(len(self._nodes)):
            if node != stopped and node not in self._ended:
                self._command(node, command)

    def _command(self, node: int, command: str) -> None:
        """Carries "cancel", "kill" or "gather" to the node's agent."""
        raise NotImplementedError

    def close(self) -> None:
        """Once the run is over: what the cluster holds for it released, then the threads that
        carry the nodes' news joined (one still waiting on a killed agent gets its error at once
        and stops); only then can the pipe go, or a late write could land in a descriptor reused
        meanwhile."""
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()
        self._release()
        for thread in self._news_threads:
            thread.join(self.news_stop_s)
        if not any(thread.is_alive() for thread in self._news_threads):
            os.close(self._news_read)
            os.close(self._news_write)

    def _release(self) -> None:
        """Ends what carries the agents (their placement group, srun)."""
        raise NotImplementedError
