"""Shared fixtures: a private runs directory for the session, and proof after every test
that no process of any run it started is left, nor any spare rank (but the session's one tracking agent, which
lives as long as its caller and is stopped, and proved gone, when the session ends)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from processes import processes_of_runs_under, processes_with_environment, tracking_agents_of  # noqa: E402

# A test run started in the background (`make test &`) inherits SIGINT ignored, and so would
# every caller a test starts: Python then never raises KeyboardInterrupt there, and the Ctrl+C
# tests hang. A handler here is reset to the default in each child at exec, as in a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)

_RUNS = tempfile.mkdtemp(prefix="fanrun-test-runs-")
# Set before any test runs, so that callers started as subprocesses inherit it too.
os.environ["FANRUN_RUNS_DIR"] = _RUNS
# Every call would otherwise be an MLflow run, with a line of its own in the output;
# test_tracking.py turns tracking back on for its tests.
os.environ["FANRUN_TRACKING"] = "0"
# Calls are cold unless a test asks for warm ones, whatever the machine's cores (a function's
# calls are warm by default where it has 4 for each rank: backends/local/spares.py).
os.environ["FANRUN_WARM"] = "0"
# The tests of what ranks print read it line by line in the cell, as display="logs" shows it;
# the panel's tests (test_panel*.py) unset this, so that a notebook's default is the panel.
os.environ["FANRUN_DISPLAY"] = "logs"
# fanrun's default MLflow store lives under $XDG_DATA_HOME: the tests' own, never the user's.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="fanrun-test-data-")

import fanrun._tracking.agent_connection  # noqa: E402
import fanrun._launch.run  # noqa: E402

# The tests that read a call's exact output run in this process, in any order: the line a
# process shows once when it finds no GPU would land in whichever came first. The tests of
# that line run their callers as subprocesses.
fanrun._launch.run.no_gpu_notice_shown = True


@pytest.fixture(scope="session")
def runs_dir() -> Path:
    return Path(_RUNS)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    agent = fanrun._tracking.agent_connection.agent_pid()
    left = processes_of_runs_under(_RUNS) + [found for found in tracking_agents_of(os.getpid()) if found[0] != agent]
    left += processes_with_environment(f"FANRUN_SPARE_OF={os.getpid()}".encode())  # spare ranks (backends/local/spares.py)
    # Detached runs' runners (_detached/runner.py): every test waits for, or cancels, the runs it starts.
    left += [found for found in processes_with_environment(f"FANRUN_RUNS_DIR={_RUNS}".encode())
             if "fanrun._detached.runner" in found[1]]
    assert not left, f"processes of fanrun runs are still alive after the test: {left}"


@pytest.fixture(scope="session", autouse=True)
def tracking_agent_stopped_at_the_end():
    yield
    fanrun._tracking.agent_connection.shutdown(wait_s=60)
    assert tracking_agents_of(os.getpid()) == []
