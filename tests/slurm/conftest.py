"""One Slurm cluster for every Slurm test: a controller and two nodes of 2 CPUs each on this
machine (cluster.py), started once and stopped at the end, with proof that none of its processes,
nor any of its jobs', is left.

These tests run inside a network namespace of their own (`make test-slurm` runs them under
tests/ray/netns.py), where only loopback is up: every daemon listens on 127.0.0.1 there, and
nothing listens beyond."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from cluster import ClusterDidNotStart, LocalSlurm, missing_binaries
from loopback_address import add_second_loopback_address


@pytest.fixture(scope="session")
def slurm_cluster():
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found): `make test-slurm` installs "
                    f"Debian's slurm-wlm and munge")
    interfaces = [name for _, name in socket.if_nameindex()]
    if interfaces != ["lo"]:
        pytest.fail(f"the Slurm tests run in a network namespace with loopback alone (python tests/ray/netns.py "
                    f"python -m pytest tests/slurm); this one has {interfaces}")
    add_second_loopback_address()
    # Not under pytest's own basetemp, which is 0700: munged needs its socket's folders open to all.
    directory = Path(tempfile.mkdtemp(prefix="fanrun-test-slurm-"))
    cluster = LocalSlurm(directory)
    try:
        cluster.start()
    except ClusterDidNotStart as error:
        pytest.fail(f"Slurm is installed but its cluster did not come up: {error}")
    try:
        yield cluster
    finally:
        left = cluster.stop()
    assert left == [], f"processes of the Slurm cluster or its jobs were left: {left}"
    shutil.rmtree(directory)
