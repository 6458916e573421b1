"""NodeAgent: what runs one node's ranks of a multi-node call, whichever cluster started it (a Ray
actor, a Slurm task). It starts them with the engine's own supervisor, as the local backend does
on one machine, so log capture, failure detection, stack dumps, result files and the keepers are
the same code on every node. Everything that happens is kept in an outbox that the caller drains
(next_batch), with the node's ranks renamed to their global numbers.

Each rank runs under a keeper (kept_process.h) that kills the rank and everything it started as
soon as this process dies, whoever kills it.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import sys
import threading
import time

from .. import _core
from .._spec.paths import RunPaths
from .local.rendezvous import Rendezvous
from .._rank import tracking as rank_tracking
from .._rank.contract import (ENV_NODE_ID, ENV_PROGRESS, error_name, forensics_collectives_name, log_name,
                              progress_name, result_name)
from .._rank.contract import STACK_DUMP_SIGNAL
from .metric_relay import MetricRelay
from . import rank_evidence, stack_dump
from .base import FAILURE_EVIDENCE_S, KILL_GRACE_S, STACK_DUMP_WAIT_S
from .local import KEEPER
from .rank_env import FORWARDED_PREFIXES, NodeLayout, flatten, rank_environment

# The most of a rank's log that goes back to the caller at the end: beyond it, the log's tail,
# and the node keeps the whole of it.
LOG_RETURN_LIMIT = 32 << 20
# How long one next_batch call may wait for news before it answers with none.
BATCH_WAIT_S = 30.0
# How long the ranks' last metrics may take to reach the caller's agent once they have ended.
RELAY_STOP_S = 30.0
# Where the call is watched for stalls: how often the ranks' progress records are read and the
# changed ones sent, as often as the caller's stall watch reads its own (_launch/stall_watch.py).
PROGRESS_EVERY_S = 1.0

_CANCEL, _KILL = b"c", b"k"


def agent_spec(launch) -> dict:
    """What every node's agent is told of one attempt (Launch), whatever cluster carries it: the
    program, the caller's forwarded environment, the timeout and the layout; each backend adds
    where node 0 is and how the payload travels."""
    plan = launch.plan
    env = {key: value for key, value in launch.env.items()
           if key.startswith(FORWARDED_PREFIXES) or key in launch.added}
    return {
        "name": launch.paths.run_id[-40:],
        "run_id": launch.paths.run_id,
        "argv": launch.program.argv,
        "python": launch.program.python,
        "cwd": os.getcwd(),
        "env": env,
        "tracked": env.get(rank_tracking.VARIABLE, rank_tracking.OFF) != rank_tracking.OFF,
        "timeout_s": float(launch.timeout) if launch.timeout is not None else 0.0,
        "health": launch.call.options.health,
        "layout": {"nodes": plan.nodes, "local_world_size": plan.world_size // plan.nodes,
                   "world_size": plan.world_size, "use_gpus": plan.use_gpus},
    }


class NodeAgent:
    # The agent's own variables, which its node's ranks do not inherit.
    dropped_env: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._outbox: list[tuple] = []  # ("events", [...]) and ("metrics", [...]), in order
        self._finished: dict | None = None
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._rendezvous: Rendezvous | None = None
        self._relay: MetricRelay | None = None
        self._supervisor = None
        self._paths: RunPaths | None = None
        self._watched = False
        self._progress_lock = threading.Lock()  # the pump's reads and a gathering's, posted in order
        self._progress_sent: dict[int, bytes] = {}
        self._progress_read_at = 0.0
        self._collectives_sent: dict[int, bytes] = {}
        self._collectives_asked_at = 0.0
        self._failure_evidence: dict[int, float] = {}  # the ranks asked before they were stopped, and when

    def check_health(self, level: str, gpus: int) -> list[dict]:
        """The cheap health gate on the `gpus` GPUs this node gives its ranks (none: a CPU call),
        before any rank of the call starts: each one's verdict (_health/node.py)."""
        if level == "off" or gpus == 0:
            return []
        from .._health import node

        return node.verdicts(gpus)

    def hold_rendezvous(self, address: str) -> int:
        """On node 0: a port on this node's address, held until just before the ranks start, when
        rank 0 binds it for torch's store."""
        self._rendezvous = Rendezvous(host_store=False, host=address)
        return self._rendezvous.port

    def start(self, spec: dict, payload: bytes | None) -> list[int]:
        """Starts this node's ranks; returns their pids, in rank order."""
        layout = NodeLayout(**spec["layout"], interface=_interface_towards(spec["master_addr"]))
        self._first_rank = layout.first_rank
        self._ranks = range(layout.first_rank, layout.first_rank + layout.local_world_size)
        self._paths = paths = RunPaths.create(spec["name"], run_id=spec["run_id"])
        # The caller watches the call for stalls: its ranks keep progress records, which go to it.
        self._watched = spec["python"] and spec["env"].get(ENV_PROGRESS) == "1"
        if payload is not None:
            paths.write_payload(_with_node_sys_path(payload))
        # The node's environment, less the agent's own; the caller's forwarded variables, then
        # fanrun's defaults, apply.
        env = {key: value for key, value in os.environ.items() if key not in self.dropped_env}
        env.update(spec["env"])
        env[ENV_NODE_ID] = spec["node_id"]
        if spec["tracked"]:
            # The ranks' MLflow socket is this agent's; what they log goes to the caller with the events.
            # The ranks' params and tags go on to the caller's relay with the metrics.
            self._relay = MetricRelay(write=self._forward_metrics, keep_keyed=False)
            self._relay.start()
            env[rank_tracking.VARIABLE] = self._relay.path
        rendezvous = {"MASTER_ADDR": spec["master_addr"], "MASTER_PORT": str(spec["master_port"])}
        argv = list(spec["argv"])
        if spec["python"]:
            argv[0] = sys.executable  # this node's own interpreter, wherever it is installed
        cwd = spec["cwd"] if os.path.isdir(spec["cwd"]) else os.getcwd()
        if self._rendezvous is not None:
            self._rendezvous.release_port_for_ranks()
        self._supervisor = _core.Supervisor.start(_core.SupervisorOptions(
            ranks=[_core.RankOptions(argv=argv, env=flatten(rank_environment(env, layout, rank, rendezvous, paths)),
                                     cwd=cwd, log_path=str(paths.log(rank)))
                   for rank in self._ranks],
            keeper_path=KEEPER,
            timeout_s=spec["timeout_s"],
            kill_grace_s=KILL_GRACE_S,
            stack_dump_signal=int(STACK_DUMP_SIGNAL) if spec["python"] else 0,
            stack_dump_wait_s=STACK_DUMP_WAIT_S,
            wakeup_fd=self._wake_read,
            expect_done=payload is not None,
            failure_evidence_s=FAILURE_EVIDENCE_S if self._watched else 0.0,
        ))
        threading.Thread(target=self._pump, name="fanrun-node-pump", daemon=True).start()
        return [self._supervisor.pid(local) for local in range(layout.local_world_size)]

    def publish(self, answer: dict) -> None:
        """The call's MLflow run, for this node's ranks: what the caller's agent told the caller."""
        if self._relay is not None:
            self._relay.publish(answer)

    def cancel(self) -> None:
        os.write(self._wake_write, _CANCEL)

    def gather(self) -> None:
        """A stall's evidence from this node's ranks, without stopping them: asked on a thread of
        its own (it waits for them up to rank_evidence.WAIT_S), and posted with their records
        read afresh."""
        threading.Thread(target=self._gather, name="fanrun-node-evidence", daemon=True).start()

    def _gather(self) -> None:
        supervisor, first = self._supervisor, self._first_rank
        try:
            running = {rank: supervisor.pid(rank - first) for rank in self._ranks
                       if supervisor.exit_status(rank - first) is None}
            answers = rank_evidence.ask(self._paths.directory, self._ranks, running)
            self._send_progress()
        except Exception as error:  # the caller hears why, and still makes its verdict from the rest
            answers = rank_evidence.unasked(self._ranks, f"its node's agent failed to ask it: {type(error).__name__}: "
                                                         f"{error}")
        self._post(("evidence", answers))

    def kill(self) -> None:
        os.write(self._wake_write, _KILL)

    def next_batch(self) -> tuple[list[tuple], dict | None]:
        """(what happened since the last call, the node's end once everything before it is taken)."""
        with self._changed:
            self._changed.wait_for(lambda: self._outbox or self._finished is not None, timeout=BATCH_WAIT_S)
            batch, self._outbox = self._outbox, []
            return batch, self._finished

    def _pump(self) -> None:
        try:
            finished = self._follow_ranks()
        except BaseException as error:  # a fault of fanrun's: the ranks go, and the caller hears why
            self._supervisor.kill_and_reap()
            finished = {"agent_error": f"{type(error).__name__}: {error}"}
        with self._changed:
            self._finished = finished
            self._changed.notify_all()

    def _follow_ranks(self) -> dict:
        supervisor = self._supervisor
        while True:
            events, interrupted, done = supervisor.wait(PROGRESS_EVERY_S if self._watched else -1.0)
            if interrupted:
                commands = os.read(self._wake_read, 64)
                if _KILL in commands:
                    supervisor.kill_and_reap()
                elif _CANCEL in commands:
                    if supervisor.stop_reason == _core.StopReason.NONE:
                        # Stopped for a failure on another node (or by the caller): what each rank
                        # was doing is asked first, as for a failure on this one.
                        self._ask_for_collectives_now()
                    supervisor.cancel()
            if supervisor.gathering_failure_evidence:
                self._ask_for_collectives_now()
                supervisor.end_failure_evidence()
            # Pickled to the caller (_core.Event pickles), each rank renumbered among the run's.
            global_events = [event.with_rank(event.rank + self._first_rank) if event.rank >= 0 else event
                             for event in events]
            obstacles = {}
            if any(event.kind == _core.EventKind.TIMED_OUT for event in events):
                for local in supervisor.ranks_running_at_timeout:
                    obstacle = stack_dump.obstacle(supervisor.pid(local), STACK_DUMP_SIGNAL)
                    if obstacle is not None:
                        obstacles[local + self._first_rank] = obstacle
            if global_events or obstacles:
                self._post(("events", global_events, obstacles))
            if self._watched and (done or time.monotonic() - self._progress_read_at >= PROGRESS_EVERY_S):
                self._send_progress()  # at the end too: the caller's goodput ledger takes the last ones
            if done:
                break
        if self._relay is not None:
            self._relay.stop(RELAY_STOP_S)  # its last values are posted before the end
        return self._ending(supervisor)

    def _ending(self, supervisor) -> dict:
        first = self._first_rank
        reason = supervisor.stop_reason
        ending = {
            "stop_reason": reason,
            "first_failed_rank": supervisor.first_failed_rank + first if reason == _core.StopReason.RANK_FAILED else -1,
            "running_at_timeout": [local + first for local in supervisor.ranks_running_at_timeout],
            "exits": {rank: supervisor.exit_status(rank - first) for rank in self._ranks},
            "failure_evidence": self._failure_evidence,
            "files": {},
        }
        # The markers a rank leaves when what it logged to MLflow was dropped (the call was not
        # tracked, or this node cannot see the caller's store): the caller says so once.
        names = [rank_tracking.DROPPED_MARKER, rank_tracking.UNREACHABLE_MARKER]
        for rank in self._ranks:
            names += [result_name(rank), error_name(rank), log_name(rank)]
        for name in names:
            data = _read(self._paths.directory / name, LOG_RETURN_LIMIT if name.endswith(".log") else None)
            if data is not None:
                ending["files"][name] = data
        self._paths.remove_bulky_files(first + len(self._ranks))
        self._paths.close()
        return ending

    def _ask_for_collectives_now(self) -> None:
        """This node's ranks still running, but the one whose failure came first, say which
        collectives they hold open (rank_evidence.collectives_now); sent to the caller with the
        progress records at the end, for failure_peers.py."""
        if not self._watched:
            return
        supervisor, first = self._supervisor, self._first_rank
        failed = supervisor.first_failed_rank + first if supervisor.stop_reason == _core.StopReason.RANK_FAILED else -1
        running = [rank for rank in self._ranks if rank != failed and supervisor.exit_status(rank - first) is None]
        self._failure_evidence.update(rank_evidence.collectives_now(self._paths.directory, running, FAILURE_EVIDENCE_S))

    def _send_progress(self) -> None:
        """Posts the progress records of this node's ranks that changed since they were last sent,
        as their bytes: the caller keeps them in its own run directory, where its stall watch,
        tracking's step times and the goodput ledger read a local call's. So too their answers
        with their flight recorders' collectives, which this agent asks of them every
        COLLECTIVES_EVERY_S, for the caller's straggler watch."""
        with self._progress_lock:
            self._progress_read_at = time.monotonic()
            changed = _changed(self._paths.directory, self._ranks, progress_name, self._progress_sent)
            if changed:
                self._post(("progress", changed))
            collectives = _changed(self._paths.directory, self._ranks, forensics_collectives_name,
                                   self._collectives_sent)
            if collectives:
                self._post(("collectives", collectives))
            if self._progress_read_at - self._collectives_asked_at >= rank_evidence.COLLECTIVES_EVERY_S:
                self._collectives_asked_at = self._progress_read_at
                supervisor, first = self._supervisor, self._first_rank
                rank_evidence.ask_for_collectives(self._paths.directory, [
                    rank for rank in self._ranks if supervisor.exit_status(rank - first) is None])

    def _forward_metrics(self, records: list) -> None:
        self._post(("metrics", records))

    def _post(self, item: tuple) -> None:
        with self._changed:
            self._outbox.append(item)
            self._changed.notify_all()


def _changed(directory, ranks, name, sent: dict[int, bytes]) -> dict[int, bytes]:
    """The ranks' files `name(rank)` whose bytes changed since they were last sent, noted as sent."""
    changed = {}
    for rank in ranks:
        data = _read(directory / name(rank), None)
        if data and data != sent.get(rank):
            changed[rank] = sent[rank] = data
    return changed


def _read(path, limit: int | None) -> bytes | None:
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if limit is not None and size > limit:
                file.seek(size - limit)
                note = f"[fanrun: the first {size - limit} bytes of this log are on its node, in {path}]\n"
                return note.encode() + file.read()
            return file.read()
    except FileNotFoundError:
        return None


def _with_node_sys_path(payload: bytes) -> bytes:
    """The payload, its header's sys.path extended with this node's own entries: the caller's come
    first (a notebook's folder), and this node's installation is still found where it differs."""
    stream = io.BytesIO(payload)
    header = pickle.load(stream)
    caller_path = list(header["sys_path"])
    header["sys_path"] = caller_path + [entry for entry in sys.path if entry not in caller_path]
    return pickle.dumps(header) + payload[stream.tell():]


def _interface_towards(address: str) -> str:
    """The name of this node's network interface that reaches `address` (node 0's)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # a datagram socket only picks its route: nothing is sent
        local = probe.getsockname()[0]
    for _index, name in socket.if_nameindex():
        if _address_of(name, family) == local:
            return name
    return "lo" if local.startswith("127.") or local == "::1" else ""


def _address_of(interface: str, family: int) -> str | None:
    if family != socket.AF_INET:
        return None
    import fcntl
    import struct

    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        try:
            answer = fcntl.ioctl(query.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])
