"""tests/ray/netns.py, which the Ray tests and benchmarks run under: loopback alone, and a
command that leaves a process running in the namespace fails, with that process killed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from processes import alive

NETNS = Path(__file__).parent / "ray" / "netns.py"


def netns(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(NETNS), "--grace", "0.5", *command],
                          capture_output=True, text=True, timeout=60)


def test_the_command_sees_loopback_alone_and_its_status_is_kept():
    done = netns(sys.executable, "-c", "import socket, sys; print([n for _, n in socket.if_nameindex()]); sys.exit(3)")
    assert done.stdout.strip() == "['lo']", done.stderr
    assert done.returncode == 3


def test_a_process_left_in_the_namespace_is_killed_named_and_fails_the_run():
    done = netns("sh", "-c", "sleep 300 & echo $!")
    left = int(done.stdout.strip())
    assert done.returncode == 1
    assert re.search(rf"left 1 processes running .*\n  {left}: sleep 300", done.stderr), done.stderr
    assert not alive(left)
