"""A stalled call's evidence, asked of real rank processes (backends/rank_evidence.py and the rank's
side in _rank/progress.py). A rank that answers on its FIFO is never signalled: faulthandler's
dump from a signal handler reads the threads without the GIL, and crashed a rank whose other
thread ran Python meanwhile. Only a rank whose GIL is held, which cannot answer, is signalled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fanrun._rank import contract
from fanrun.backends import rank_evidence

# A rank whose second thread runs Python all the time, as a logging or prefetching thread does,
# while its main thread waits where the first argument says: in time.sleep, or in a read through
# PyDLL, which keeps the GIL for as long as it waits.
RANK = textwrap.dedent("""\
    import ctypes, json, os, sys, threading, time, traceback
    from fanrun._rank import progress

    progress.install(sys.argv[1], 0)

    def churn():
        while True:
            json.dumps(traceback.format_stack())

    def wait_in_sleep():
        print("ready", flush=True); time.sleep(600)

    def wait_holding_the_gil():
        read_end, _write_end = os.pipe()
        print("ready", flush=True); ctypes.PyDLL(None).read(read_end, ctypes.create_string_buffer(1), 1)

    threading.Thread(target=churn, name="churn", daemon=True).start()
    {"sleep": wait_in_sleep, "gil": wait_holding_the_gil}[sys.argv[2]]()
    """)
ASKS = 20  # the crash came in about one ask of a hundred, with the signal sent to every rank


@pytest.fixture
def rank(tmp_path):
    """rank(mode): (run directory, pid) of a rank that waits as `mode` says; killed after the test."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    started = []

    def start(mode: str) -> tuple[Path, subprocess.Popen]:
        run_dir = tmp_path / mode
        run_dir.mkdir()
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(contract.__file__).parents[2]),
                                                                     os.environ.get("PYTHONPATH", "")])}
        process = subprocess.Popen([sys.executable, str(script), str(run_dir), mode], stdout=subprocess.PIPE,
                                   text=True, env=environment)
        started.append(process)
        assert process.stdout.readline() == "ready\n"
        return run_dir, process

    yield start
    for process in started:
        process.kill()
        process.wait()
        process.stdout.close()


def test_a_rank_that_answers_gives_every_threads_stack_and_is_never_signalled(rank):
    run_dir, process = rank("sleep")
    for _ in range(ASKS):
        (given,) = rank_evidence.ask(run_dir, [0], {0: process.pid}).values()
        assert given.answer is not None and "stacks" in given.answer, given
        assert given.stack == given.answer["stacks"]
        # Every thread but the forensics thread, the main one last, as faulthandler writes them.
        threads = given.stack.split("\n\n")
        assert [thread.split("\n", 1)[0].split(" [")[1] for thread in threads] == [
            "churn] (most recent call first):", "MainThread] (most recent call first):"], given.stack
        assert "in churn" in threads[0] and "in wait_in_sleep" in threads[1] and "in <module>" in threads[1]
        assert given.answer["main_stack"][-1][2] == "wait_in_sleep"
        assert process.poll() is None
    # faulthandler never dumped: the stacks file is as the rank made it.
    assert (run_dir / contract.forensics_stacks_name(0)).stat().st_size == 0


def test_a_rank_whose_gil_is_held_is_signalled_once_it_gives_no_answer(rank):
    run_dir, process = rank("gil")
    asked = time.monotonic()
    (given,) = rank_evidence.ask(run_dir, [0], {0: process.pid}).values()
    took = time.monotonic() - asked
    assert given.answer is None
    assert rank_evidence.ANSWER_S <= took <= rank_evidence.WAIT_S + 1.0, took
    assert "in wait_holding_the_gil" in given.stack and "in churn" in given.stack, given.stack
    assert process.poll() is None


def test_a_process_without_a_fifo_is_neither_asked_nor_signalled(tmp_path):
    # The rank of a native program: no forensics thread, and no handler for the signal, whose
    # default action would end it.
    with subprocess.Popen(["sleep", "600"]) as process:
        try:
            (given,) = rank_evidence.ask(tmp_path, [0], {0: process.pid}).values()
            assert (given.answer, given.stack) == (None, "")
            assert process.poll() is None
        finally:
            process.kill()
