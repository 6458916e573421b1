"""No rank, nor anything it started, outlives its caller: interrupted with SIGINT, or killed with SIGKILL."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap

import pytest

from processes import alive, processes_with_environment, wait_gone

CALLER = textwrap.dedent(
    """
    from fanrun import distributed

    @distributed(num_accelerators=2)
    def wait_forever():
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])  # something the rank started itself
        print("pids", os.getpid(), child.pid, flush=True)
        time.sleep(300)

    @distributed(num_accelerators=2)
    def quick():
        import os
        return int(os.environ["RANK"])

    try:
        wait_forever.distributed()
    except KeyboardInterrupt:
        print("caller: interrupted", flush=True)
        print("caller: still usable", quick.distributed(), flush=True)
    """
)


def start_caller(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    lines = []
    while len(pids) < 4:
        line = caller.stdout.readline()
        if not line:
            caller.wait(10)
            pytest.fail(f"caller ended before the ranks started: {lines} {caller.stderr.read()}")
        lines.append(line)
        match = re.match(r"\[rank\d\]: pids (\d+) (\d+)", line)
        if match:
            pids += [int(match.group(1)), int(match.group(2))]
    return caller, pids


def test_sigint_stops_every_rank_and_what_it_started(tmp_path):
    caller, pids = start_caller(tmp_path)
    assert all(alive(pid) for pid in pids)
    caller.send_signal(signal.SIGINT)
    out, err = caller.communicate(timeout=60)
    assert caller.returncode == 0, err
    assert "caller: interrupted" in out
    assert "caller: still usable [0, 1]" in out
    assert wait_gone(pids, timeout=5) == []


def keepers_of(caller: subprocess.Popen) -> list[int]:
    """The fanrun-keeper of each rank of `caller` (its command line names its owner's pid)."""
    return [
        pid
        for pid, command in processes_with_environment(b"FANRUN_RUN_DIR=")
        if command.split()[0].endswith("fanrun-keeper") and command.split()[1] == str(caller.pid)
    ]


def test_sigkill_of_the_caller_leaves_no_rank(tmp_path):
    caller, pids = start_caller(tmp_path)
    keepers = keepers_of(caller)
    assert len(keepers) == 2, keepers
    caller.kill()
    caller.wait(10)
    caller.stdout.close()
    caller.stderr.close()
    ranks = pids[0::2]
    assert wait_gone(ranks, timeout=10) == [], "a rank outlived its killed caller"
    assert wait_gone(pids[1::2], timeout=10) == [], "what a rank started outlived its killed caller"
    # Each keeper kills and reaps what is left of its rank, then leaves.
    assert wait_gone(keepers, timeout=10) == [], "a rank's keeper outlived its killed caller"
