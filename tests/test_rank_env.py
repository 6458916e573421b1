"""Every rank's environment for its place among a run's nodes (backends/rank_env.py), and the
interface a node's ranks reach node 0 through (backends/ray/node_agent.py)."""

from __future__ import annotations

import socket

import pytest

from fanrun._spec.paths import RunPaths
from fanrun.backends.rank_env import NodeLayout, rank_environment
from fanrun.backends.node_agent import _interface_towards


@pytest.fixture
def paths():
    with RunPaths.create("rank-env") as made:
        yield made


def test_a_rank_of_node_1_of_2_gets_its_global_and_local_place(paths):
    layout = NodeLayout(node_rank=1, nodes=2, local_world_size=4, world_size=8, use_gpus=True, interface="eth7")
    env = rank_environment({"PATH": "/bin"}, layout, 6, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, paths)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    # The interface towards node 0, not loopback; GPU ranks keep the node's CUDA_VISIBLE_DEVICES.
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth7"
    assert "CUDA_VISIBLE_DEVICES" not in env and env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1"


def test_the_callers_own_interface_and_threads_win(paths):
    layout = NodeLayout(node_rank=0, nodes=2, local_world_size=1, world_size=2, use_gpus=False, interface="eth7")
    env = rank_environment({"NCCL_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": "8"}, layout, 0, {}, paths)
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["GLOO_SOCKET_IFNAME"] == "eth7"
    assert env["OMP_NUM_THREADS"] == "8" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_an_interface_that_could_not_be_told_is_left_to_gloo_and_nccl(paths):
    layout = NodeLayout(node_rank=0, nodes=2, local_world_size=1, world_size=2, use_gpus=False, interface="")
    env = rank_environment({}, layout, 0, {}, paths)
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env


def test_the_interface_towards_an_address_is_the_one_that_holds_the_route():
    assert _interface_towards("127.0.0.1") == "lo"
    own = {name: address for name, address in _ipv4_interfaces().items() if name != "lo"}
    if not own:
        pytest.skip("this machine has no network interface but loopback")
    # Node 0's address on the same network: the packets would leave through that interface.
    name, address = sorted(own.items())[0]
    assert _interface_towards(address) == name


def _ipv4_interfaces() -> dict[str, str]:
    from fanrun.backends.node_agent import _address_of

    found = {}
    for _index, name in socket.if_nameindex():
        address = _address_of(name, socket.AF_INET)
        if address:
            found[name] = address
    return found
