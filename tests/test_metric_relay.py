"""The ranks' metrics travel to the tracking agent over real sockets: MetricSender in the rank,
MetricRelay in the agent, which writes them to the store in batches; the socket itself travels
from the caller to the agent over their control channel."""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fanrun._tracking import agent_channel as _agent_channel
from fanrun.backends import metric_relay as _metric_relay
from fanrun.backends.metric_relay import MetricRelay

SENDER = Path(_metric_relay.__file__).parents[1] / "_rank" / "metric_sender.py"
_MetricSender = runpy.run_path(str(SENDER))["MetricSender"]


def MetricSender(path: str, interval_s: float):  # noqa: N802 (stands for the class)
    """A rank's sender, on a socket connected to the relay as a rank's first `import mlflow` connects it."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    channel.connect(path)
    return _MetricSender(channel, interval_s)


def record(key: str, value: float, step: int) -> tuple:
    return (key, value, 1_700_000_000_000 + step, step, None, None, None)


class Store:
    """What the relay writes to: the batches, in order."""

    def __init__(self) -> None:
        self.batches: list[list[tuple]] = []

    def write(self, batch: list[tuple]) -> None:
        self.batches.append(list(batch))

    def values(self) -> list[tuple]:
        return sorted(r for batch in self.batches for r in batch)


@pytest.fixture
def relay_and_store():
    store = Store()
    relay = MetricRelay(store.write)
    relay.start()
    yield relay, store
    relay.stop(5.0)


def test_values_of_every_sender_are_written_once_in_few_batches(relay_and_store):
    relay, store = relay_and_store
    senders = [MetricSender(relay.path, interval_s=0.2) for _ in range(3)]
    expected = []
    for step in range(300):
        for index, sender in enumerate(senders):
            sender.add([record(f"loss_{index}", step * 0.5, step)])
            expected.append(record(f"loss_{index}", step * 0.5, step))
    for sender in senders:
        sender.flush()
    assert relay.stop(5.0)
    assert store.values() == sorted(expected)
    assert relay.written == 900 and relay.dropped == 0 and relay.error is None
    # 900 values from three senders buffering, then the caller's own interval: a handful of writes.
    assert len(store.batches) <= 10, [len(b) for b in store.batches]
    assert not os.path.exists(relay.path)


def test_params_and_tags_of_other_ranks_are_kept_for_the_close_not_written(relay_and_store):
    """A rank other than 0 sends its params and tags beside its metrics: the metrics are written,
    the params and tags kept, in order, for the run's close (rank_values.py)."""
    relay, store = relay_and_store
    sender = MetricSender(relay.path, interval_s=0.0)
    sender.add([record("loss/rank_1", 1.0, 0), ("param", 1, "seed", "1001"), ("tag", 1, "role", "worker")])
    sender.add([("tag", 1, "role", "still a worker"), record("loss/rank_1", 2.0, 1)])
    assert relay.stop(5.0)
    assert store.values() == [record("loss/rank_1", 1.0, 0), record("loss/rank_1", 2.0, 1)]
    assert relay.keyed == [("param", 1, "seed", "1001"), ("tag", 1, "role", "worker"), ("tag", 1, "role", "still a worker")]


def test_a_relay_that_forwards_passes_params_and_tags_on_with_the_metrics():
    """A cluster node's relay forwards to the caller's: every record goes on, in order."""
    store = Store()
    relay = MetricRelay(store.write, keep_keyed=False)
    relay.start()
    sender = MetricSender(relay.path, interval_s=0.0)
    sender.add([record("loss/rank_2", 1.0, 0), ("param", 2, "seed", "1002")])
    assert relay.stop(5.0)
    assert store.batches == [[record("loss/rank_2", 1.0, 0), ("param", 2, "seed", "1002")]]
    assert relay.keyed == []


def test_values_wait_no_longer_than_the_two_intervals(relay_and_store, monkeypatch):
    relay, store = relay_and_store
    sender = MetricSender(relay.path, interval_s=0.1)
    started = time.monotonic()
    sender.add([record("loss", 1.0, 0)])
    while not store.batches and time.monotonic() - started < 10:
        time.sleep(0.02)
    waited = time.monotonic() - started
    assert store.values() == [record("loss", 1.0, 0)]
    assert waited < 0.1 + _metric_relay.WRITE_INTERVAL_S + 2.0, waited


def test_a_forked_child_sends_each_value_at_once_on_the_shared_socket(relay_and_store):
    relay, store = relay_and_store
    sender = MetricSender(relay.path, interval_s=60.0)  # the parent's values wait for flush()
    sender.add([record("parent", 1.0, 0)])
    pid = os.fork()
    if pid == 0:  # a DataLoader worker: ends with os._exit, no exit handler runs
        try:
            for step in range(50):
                sender.add([record("child", 2.0, step)])
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    sender.flush()
    assert relay.stop(5.0)
    assert store.values() == sorted([record("parent", 1.0, 0)] + [record("child", 2.0, s) for s in range(50)])


def test_a_failing_store_drops_the_rest_and_says_why():
    written = []

    def write(batch):
        if written:
            raise ConnectionError("store went away")
        written.extend(batch)

    relay = MetricRelay(write)
    relay.start()
    sender = MetricSender(relay.path, interval_s=0.0)
    sender.add([record("loss", 1.0, 0)])
    while not written:
        time.sleep(0.02)
    for step in range(1, 6):
        sender.add([record("loss", 1.0, step)])
    assert relay.stop(5.0)
    assert relay.written == 1 and relay.dropped == 5
    assert isinstance(relay.error, ConnectionError)


def test_a_store_that_hangs_costs_the_timeout_not_a_hang():
    release = threading.Event()
    relay = MetricRelay(lambda batch: release.wait(30))
    relay.start()
    MetricSender(relay.path, interval_s=0.0).add([record("loss", 1.0, 0)])
    time.sleep(0.2)  # the relay is now inside the store's write
    started = time.monotonic()
    assert not relay.stop(0.5)
    assert time.monotonic() - started < 3
    release.set()


def test_a_process_left_holding_a_socket_does_not_delay_the_end(relay_and_store):
    relay, store = relay_and_store
    sender = MetricSender(relay.path, interval_s=0.0)
    sender.add([record("loss", 1.0, 0)])
    pid = os.fork()
    if pid == 0:  # a grandchild of a rank that outlives it, holding the socket open
        time.sleep(60)
        os._exit(0)
    try:
        started = time.monotonic()
        assert relay.stop(5.0)
        assert time.monotonic() - started < 3
        assert store.values() == [record("loss", 1.0, 0)]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_temporary_folder_too_deep_for_a_socket_is_refused_and_left_clean(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(OSError, match="longer than 107 bytes"):
        MetricRelay(lambda batch: None)
    assert list(deep.iterdir()) == []  # the caller's tracking is then off for the call, with a warning


def test_every_rank_gets_the_answer_once_whether_it_connects_before_or_after_it_is_known(relay_and_store):
    """The socket exists before the run does: a rank that connects early waits for the answer,
    one that connects later gets it at once, and each gets it exactly once, first."""
    relay, store = relay_and_store
    early = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    early.connect(relay.path)
    early.settimeout(0.3)
    with pytest.raises(TimeoutError):
        early.recv(1 << 16)  # nothing yet: the run is still being made
    relay.publish({"run_id": "abc", "env": {"MLFLOW_RUN_ID": "abc"}})
    relay.publish({"run_id": "ignored"})  # the first answer stands
    late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    late.connect(relay.path)
    for channel in (early, late):
        channel.settimeout(10)
        assert json.loads(channel.recv(1 << 16)) == {"run_id": "abc", "env": {"MLFLOW_RUN_ID": "abc"}}
        channel.settimeout(0.3)
        with pytest.raises(TimeoutError):
            channel.recv(1 << 16)
    # Then the same socket carries the rank's values.
    sender = _MetricSender(late, 0.0)
    sender.add([record("loss", 1.0, 0)])
    assert relay.stop(5.0)
    assert store.values() == [record("loss", 1.0, 0)]
    early.close()


AGENT_SERVING_ONE_CALL = """
import json, os, socket, sys
from fanrun._tracking.agent_channel import receive
from fanrun.backends.metric_relay import MetricRelay

control = socket.socket(fileno=int(sys.argv[1]))
message, fds = receive(control)
received = []
relay = MetricRelay(received.extend, socket.socket(fileno=fds[0]))
relay.start()
relay.publish({"run_id": message["call"]["id"]})
print(json.dumps({"close_on_exec": not os.get_inheritable(fds[0]), "call": message["call"]}), flush=True)
finish, _ = receive(control)
relay.stop(5.0)
print(json.dumps({"finish": finish, "values": [list(r) for r in received]}), flush=True)
"""


def test_a_calls_socket_handed_over_the_control_channel_is_served_where_it_arrives():
    """The caller makes a call's socket before the ranks start and hands it to the agent, a
    process already running, beside the call's message (SCM_RIGHTS): a rank that connects to the
    path it was given reaches the relay there, gets its answer and delivers its values; the
    descriptor arrives close-on-exec, so nothing the agent starts holds it."""
    caller_end, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent = subprocess.Popen([sys.executable, "-c", AGENT_SERVING_ONE_CALL, str(agent_end.fileno())],
                             pass_fds=(agent_end.fileno(),), stdout=subprocess.PIPE, text=True)
    agent_end.close()
    call_socket = _metric_relay.RelaySocket()
    try:
        _agent_channel.send(caller_end, {"call": {"id": 7}}, (call_socket.listener.fileno(),))
        call_socket.listener.close()  # the caller keeps only the path: the agent's copy serves
        first = json.loads(agent.stdout.readline())
        assert first == {"close_on_exec": True, "call": {"id": 7}}
        rank = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        rank.connect(call_socket.path)
        rank.settimeout(10)
        assert json.loads(rank.recv(1 << 16)) == {"run_id": 7}
        _MetricSender(rank, 0.0).add([record("loss", 0.5, 3)])
        rank.close()
        _agent_channel.send(caller_end, {"finish": {"id": 7}})
        assert json.loads(agent.stdout.readline()) == {"finish": {"finish": {"id": 7}}, "values": [list(record("loss", 0.5, 3))]}
        assert agent.wait(30) == 0
    finally:
        caller_end.close()
        if agent.poll() is None:
            agent.kill()
            agent.wait(30)
        agent.stdout.close()
        call_socket.close()
