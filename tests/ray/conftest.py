"""One Ray cluster for every Ray test: a head (with its dashboard, for Ray Jobs) and a worker node
of 2 CPUs each, on this machine, started once and stopped at the end, with proof that none of
its processes is left.

These tests run inside a network namespace of their own (netns.py; `make test` does it), where
only loopback is up: Ray binds every service to 127.0.0.1 there, and nothing listens beyond."""

from __future__ import annotations

import os
import socket
import sys

import pytest

CPUS_PER_NODE = 2


def ray_processes(session_dir: str) -> list[tuple[int, str]]:
    """Live processes of the Ray session in `session_dir` (each names it on its command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as file:
                zombie = file.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if session_dir in command and not zombie:
            found.append((int(entry), command[:160]))
    return found


@pytest.fixture(scope="session")
def cluster():
    interfaces = [name for _, name in socket.if_nameindex()]
    if interfaces != ["lo"]:
        pytest.fail(f"the Ray tests run in a network namespace with loopback alone (python tests/ray/netns.py "
                    f"python -m pytest tests/ray); this one has {interfaces}")
    from ray.cluster_utils import Cluster

    import fanrun

    # A job's entrypoint (`python -m fanrun...`) finds this environment's python, as in an activated one.
    os.environ["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"
    # The dashboard serves Ray Jobs (test_ray_jobs.py).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": True})
    session_dir = cluster.head_node.get_session_dir_path()
    try:
        # Each node unpacks a job's working_dir in a folder of its own, as on two machines: in the
        # session's shared folder, the second node's copy would replace the first's under its driver.
        cluster.add_node(num_cpus=CPUS_PER_NODE, runtime_env_dir_name="runtime_resources_node1")
        cluster.wait_for_nodes()
        fanrun.ray_init(address=cluster.address)
        yield cluster
    finally:
        fanrun.ray_shutdown()
        cluster.shutdown()
    from processes import wait_gone

    left = ray_processes(session_dir)
    assert wait_gone([pid for pid, _ in left], timeout=30) == [], f"Ray processes left: {left}"


@pytest.fixture(scope="session")
def jobs_address(cluster) -> str:
    """The cluster's job server, as `ray job submit --address` takes it."""
    return f"http://{cluster.head_node.address_info['webui_url']}"
