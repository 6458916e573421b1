"""A stall's verdict (_launch/verdict.py): the planted cases the product must name, each in its exact
sentence, culprits and cause, on stacks that faulthandler wrote for real in a stuck process."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fanrun._launch.stall_report import RankEvidence, RankProgress
from fanrun._launch.verdict import parse_stack, verdict
from fanrun._rank import contract
from fanrun.backends import rank_evidence

# A process stuck where a mode says, with a second thread waiting, whose every thread's stack
# faulthandler dumps on SIGUSR1 (or, in "from-thread", from a third thread when a line comes on
# stdin). "ready" and a call into C that gets stuck share a line, so that the stack names that
# line whether the dump comes a moment before the call or in it; a wait in threading.py's Python
# code is told by a thread that could only take the lock once the main thread waited. "dumped"
# comes once the dump is written.
STUCK = textwrap.dedent("""\
    import ctypes, faulthandler, signal, sys, threading, time

    SLEEP_HOLDING_THE_GIL = ctypes.PyDLL(None).sleep  # PyDLL: the GIL stays held in the call
    SLEEP_RELEASING_THE_GIL = ctypes.CDLL(None).sleep  # CDLL: it is released

    def load_batch():
        print("ready", flush=True); time.sleep(60)

    def spin():
        print("ready", flush=True); SLEEP_HOLDING_THE_GIL(60)

    def wait_in_c():
        print("ready", flush=True); SLEEP_RELEASING_THE_GIL(60)

    def wait_for_peers():
        peers = threading.Condition()
        with peers:
            threading.Thread(target=say_ready_once_waiting, args=(peers,), daemon=True).start()
            peers.wait(60)

    def say_ready_once_waiting(peers):
        with peers:  # its lock is free once the main thread waits in peers.wait, in threading.py
            print("ready", flush=True)

    def recurse(depth):
        if depth:
            return recurse(depth - 1)
        load_batch()

    def dump_when_asked(stacks):
        sys.stdin.readline()
        faulthandler.dump_traceback(stacks, all_threads=True)
        print("dumped", flush=True)

    MODES = {"load_batch": load_batch, "from-thread": load_batch, "spin": spin, "wait_in_c": wait_in_c,
             "wait_for_peers": wait_for_peers, "deep": lambda: recurse(150)}

    def main():
        stacks = open(sys.argv[2], "w")
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        if sys.argv[1] == "from-thread":
            threading.Thread(target=dump_when_asked, args=(stacks,), daemon=True).start()
        else:
            signal.signal(signal.SIGUSR1, lambda *_: print("dumped", flush=True))
            faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=True)
        MODES[sys.argv[1]]()

    main()
    """)


def line_of(text: str, script: str = STUCK) -> int:
    """The number of the script's one line that holds `text`."""
    (number,) = [index for index, line in enumerate(script.splitlines(), 1) if text in line]
    return number


@pytest.fixture
def stuck(tmp_path):
    """stuck(mode): every thread's stack, as faulthandler wrote it, of a process stuck in `mode`."""
    script = tmp_path / "train.py"
    script.write_text(STUCK)

    def dump(mode: str) -> str:
        stacks = tmp_path / f"{mode}.stacks"
        with subprocess.Popen([sys.executable, str(script), mode, str(stacks)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as process:
            try:
                assert process.stdout.readline() == "ready\n"
                if mode == "from-thread":
                    process.stdin.write("\n")
                    process.stdin.flush()
                else:
                    process.send_signal(signal.SIGUSR1)
                assert process.stdout.readline() == "dumped\n"
            finally:
                process.kill()
        return stacks.read_text()

    return dump


def progress(rank: int, state: str = "compute", collectives: int = 0, op: str = "", since: float = 1000.0,
             steps: int = 10, batches: int = 10) -> RankProgress:
    return RankProgress(rank=rank, state=state, pid=1000 + rank, steps=steps, batches=batches, collectives=collectives,
                        state_since=since, progress_at=since, step_at=since, step_s=0.2, step_data_s=0.01,
                        step_comm_s=0.05, data_s=1.0, comm_s=2.0, op=op)


def evidence(rank: int, record: RankProgress | None, running: bool = True, stack: str = "", frames=(),
             answered: bool = True, collectives=None) -> RankEvidence:
    return RankEvidence(rank=rank, progress=record, running=running, stack=stack, main_frames=tuple(frames),
                        answered=answered, collectives=collectives, last_lines=())


def waiting(rank: int, count: int, op: str = "all_reduce", since: float = 1000.0) -> RankEvidence:
    return evidence(rank, progress(rank, "collective", count, op, since=since))


NOW = 1094.0  # 94 s after the ranks' states began, at 1000
Judged = collections.namedtuple("Judged", "sentence culprits cause")


def judged(ranks, now: float = NOW) -> Judged:
    """The verdict, as a tuple to compare whole with the expected one."""
    found = verdict(ranks, now)
    return Judged(found.sentence, found.culprits, found.cause)


# --- the main thread's stack, from faulthandler's text ---

def test_the_main_thread_is_read_from_a_real_dump_that_the_signal_gave_it(stuck):
    text = stuck("load_batch")
    assert "Current thread" in text and text.count("(most recent call first)") == 2
    frames = parse_stack(text)
    assert [(Path(file).name, line, function) for file, line, function in frames] == [
        ("train.py", len(STUCK.splitlines()), "<module>"),
        ("train.py", line_of("MODES[sys.argv[1]]()"), "main"),
        ("train.py", line_of("time.sleep(60)"), "load_batch")]


def test_the_main_thread_is_told_by_its_outermost_frame_when_another_thread_dumps(stuck):
    """faulthandler calls the dumping thread "Current thread": the main thread is the one that
    threading did not start."""
    text = stuck("from-thread")
    current = text[text.index("Current thread"):].split("\n\n")[0]
    assert "dump_when_asked" in current
    assert [function for _, _, function in parse_stack(text)] == ["<module>", "main", "load_batch"]


def test_a_stack_cut_at_a_hundred_frames_is_still_the_main_thread(stuck):
    """faulthandler shows 100 frames at most: the deep main thread has lost its outermost frames,
    yet the threads that threading started still show theirs."""
    text = stuck("deep")
    assert "  ..." in text.splitlines()
    frames = parse_stack(text)
    assert len(frames) == 100
    assert frames[-1][1:] == (line_of("time.sleep(60)"), "load_batch")
    assert {function for _, _, function in frames[:-1]} == {"recurse"}


def test_the_last_of_several_dumps_in_one_file_is_read(stuck):
    text = stuck("load_batch") + stuck("spin")
    assert parse_stack(text)[-1][1:] == (line_of("SLEEP_HOLDING_THE_GIL(60)"), "spin")


def test_text_without_a_stack_has_no_frames():
    assert parse_stack("") == ()
    assert parse_stack("Fatal Python error: something\n\nno frames here\n") == ()
    assert parse_stack('Stack (most recent call first):\n  File "/x/a.py", line 3 in f\n'
                       '  File "/x/a.py", line 9 in <module>\n') == (("/x/a.py", 9, "<module>"), ("/x/a.py", 3, "f"))


# --- the planted cases ---

def test_a_rank_that_sleeps_in_its_dataloader_is_named_with_its_wait(stuck):
    ranks = [waiting(0, 1234), evidence(1, progress(1, "data", 1233), stack=stuck("load_batch")),
             waiting(2, 1234), waiting(3, 1234)]
    assert judged(ranks, NOW) == Judged("rank 1 is in DataLoader.__next__ (waiting for data for 94 s); "
                                   "ranks 0, 2 and 3 wait in all_reduce #1234 for it", (1,), "data")


def test_a_rank_whose_dataloader_really_sleeps_is_named_from_its_own_progress_record(tmp_path):
    """The rank side as it runs (_rank/progress.py): a DataLoader whose dataset sleeps in
    load_batch, its record read back, and its stacks and main thread's frames asked as a stall's
    evidence is."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import sys, time
        from fanrun._rank import progress
        progress.install(sys.argv[1], 0)
        import torch
        from torch.utils.data import DataLoader

        def load_batch(index):
            print("ready", flush=True); time.sleep(60)

        class Slow(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, index):
                return load_batch(index) if index == 2 else torch.zeros(1)

        for batch in DataLoader(Slow()):
            pass
        """))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(contract.__file__).parents[2]),
                                                                 os.environ.get("PYTHONPATH", "")])}
    with subprocess.Popen([sys.executable, str(script), str(run_dir)], stdout=subprocess.PIPE, text=True,
                          env=environment) as process:
        try:
            assert process.stdout.readline() == "ready\n"
            record = RankProgress.read(run_dir / contract.progress_name(0), 0)
            assert (record.state, record.batches, record.pid) == ("data", 2, process.pid)
            (given,) = rank_evidence.ask(run_dir, [0], {0: process.pid}).values()
        finally:
            process.kill()
    assert given.answer is not None, given
    dumped = parse_stack(given.stack)
    assert dumped[-1][1:] == (8, "load_batch") and dumped[0][1:] == (17, "<module>")
    frames = tuple(tuple(frame) for frame in given.answer["main_stack"])
    assert frames[-1][1:] == (8, "load_batch")
    rank = evidence(0, record, stack=given.stack, frames=frames)
    assert judged([rank], record.state_since + 94) == Judged(
        "rank 0 is in DataLoader.__next__ (waiting for data for 94 s)", (0,), "data")


def test_two_ranks_in_different_collectives_are_a_mismatch():
    assert judged([waiting(0, 57), waiting(1, 57, "broadcast")], NOW) == Judged(
        "collective mismatch at #57: rank 0 in all_reduce, rank 1 in broadcast", (0, 1), "mismatch")


def test_in_a_mismatch_the_ranks_of_the_minority_are_to_blame():
    ranks = [waiting(0, 57), waiting(1, 57, "broadcast"), waiting(2, 57), waiting(3, 57)]
    assert judged(ranks, NOW) == Judged(
        "collective mismatch at #57: ranks 0, 2 and 3 in all_reduce, rank 1 in broadcast", (1,), "mismatch")


def test_a_mismatch_comes_before_a_rank_that_is_elsewhere():
    ranks = [waiting(0, 57), waiting(1, 57, "broadcast"), evidence(2, progress(2, "data"))]
    assert judged(ranks, NOW).cause == "mismatch"


def test_the_flight_recorder_shows_a_mismatch_that_no_python_call_does():
    """Under DDP the collectives are torch's own: the records say compute, the flight recorder
    holds different operations at the same seq of the same group."""
    def recorded(*entries):
        return tuple({"seq": seq, "op": op, "state": "started", "created_ns": 10**18, "group": group}
                     for seq, op, group in entries)

    ranks = [evidence(0, progress(0), collectives=recorded((3, "nccl:all_reduce", "default_pg"),
                                                           (4, "nccl:all_reduce", "default_pg"))),
             evidence(1, progress(1), collectives=recorded((3, "nccl:all_reduce", "default_pg"),
                                                           (4, "nccl:_allgather_base", "default_pg")))]
    assert judged(ranks, NOW) == Judged("collective mismatch at #4: rank 0 in all_reduce, rank 1 in _allgather_base",
                                   (0, 1), "mismatch")
    named = [evidence(r.rank, r.progress, collectives=tuple({**entry, "group": "tp"} for entry in r.collectives))
             for r in ranks]
    assert judged(named, NOW).sentence.startswith("collective mismatch at #4 of group tp: ")


def test_point_to_point_ops_and_unnamed_groups_are_no_flight_recorder_mismatch():
    """A send takes the collective seq of its group as it stands, and torch describes every
    unnamed group as "undefined": neither tells two ranks' collectives apart."""
    def one(op, group):
        return ({"seq": 5, "op": op, "state": "started", "created_ns": 10**18, "group": group},)

    for first, second, group in [("nccl:send 0->1", "nccl:recv 0<-1", "default_pg"),
                                 ("nccl:all_reduce", "nccl:broadcast", "undefined")]:
        ranks = [evidence(0, progress(0), frames=[("/x/train.py", 3, "f")], collectives=one(first, group)),
                 evidence(1, progress(1), frames=[("/x/train.py", 3, "f")], collectives=one(second, group))]
        assert judged(ranks, NOW).cause == "native"


def test_a_rank_that_skips_a_collective_and_goes_on_is_named_where_it_is(stuck):
    """It made progress its peers did not (a batch more) yet never entered their collective."""
    stack = stuck("load_batch")
    ranks = [waiting(0, 88), waiting(1, 88), evidence(2, progress(2, collectives=87, batches=11), stack=stack),
             waiting(3, 88)]
    assert judged(ranks, NOW) == Judged(f"rank 2 never entered collective #88; it is in train.py:{line_of('time.sleep(60)')}; "
                                   "ranks 0, 1 and 3 wait in all_reduce #88 for it", (2,), "skipped")


def test_a_rank_that_skips_a_collective_into_library_code_is_named_with_the_function(stuck):
    stack = stuck("wait_for_peers")
    ranks = [waiting(0, 88), evidence(1, progress(1, collectives=87), stack=stack)]
    assert judged(ranks, NOW) == Judged(f"rank 1 never entered collective #88; it is in `wait` at "
                                   f"train.py:{line_of('peers.wait(60)')}; rank 0 waits in all_reduce #88 for it",
                                   (1,), "skipped")


def test_a_rank_stuck_in_c_code_that_holds_the_gil_is_named(stuck):
    """Its forensics thread could not answer; faulthandler, which needs no GIL, still wrote its stacks."""
    stack = stuck("spin")
    ranks = [waiting(0, 5), evidence(1, progress(1, collectives=4), stack=stack, answered=False)]
    assert judged(ranks, NOW) == Judged(f"rank 1 never entered collective #5: it is stuck in native code that holds the GIL, called "
                                   f"from `spin` at "
                                   f"train.py:{line_of('SLEEP_HOLDING_THE_GIL(60)')}; rank 0 waits in all_reduce #5 for it",
                                   (1,), "native-gil")


def test_a_rank_stuck_in_c_code_that_releases_the_gil_is_named(stuck):
    stack = stuck("wait_in_c")
    ranks = [waiting(0, 5), evidence(1, progress(1, collectives=4), stack=stack, frames=parse_stack(stack))]
    assert judged(ranks, NOW) == Judged(f"rank 1 never entered collective #5: it is in native code, called from `wait_in_c` at "
                                   f"train.py:{line_of('SLEEP_RELEASING_THE_GIL(60)')} (its GIL is free); "
                                   "rank 0 waits in all_reduce #5 for it", (1,), "native")


def test_a_rank_seen_at_two_places_runs_python_rather_than_native_code(stuck):
    """The forensics thread's frames and faulthandler's differ: the main thread moved."""
    stack = stuck("load_batch")
    moved = parse_stack(stack)[:-1] + (("/tmp/x/train.py", 99, "load_batch"),)
    ranks = [waiting(0, 5), evidence(1, progress(1, collectives=5), stack=stack, frames=moved)]
    assert judged(ranks, NOW) == Judged("rank 1 is computing in train.py:99 (no progress for 94 s); "
                                   "rank 0 waits in all_reduce #5 for it", (1,), "compute")


def test_every_rank_in_the_same_collective_blames_the_collective():
    assert judged([waiting(0, 12, since=1000), waiting(1, 12, since=990), waiting(2, 12, since=995)], NOW) == Judged(
        "every rank waits in all_reduce #12 (for 94 s): the collective itself does not complete", (), "collective")
    assert judged([waiting(0, 12)], NOW) == Judged(
        "rank 0 waits in all_reduce #12 (for 94 s): the collective itself does not complete", (), "collective")


def test_ranks_in_collectives_of_different_counts_wait_in_different_collectives():
    assert judged([waiting(0, 57), waiting(1, 58), waiting(2, 57)], NOW) == Judged(
        "ranks wait in different collectives: ranks 0 and 2 in all_reduce #57, rank 1 in all_reduce #58",
        (1,), "mismatch")


def test_a_rank_that_has_ended_is_named_as_such():
    ranks = [waiting(0, 1234), waiting(1, 1234), waiting(2, 1234), evidence(3, progress(3), running=False)]
    assert judged(ranks, NOW) == Judged("rank 3 has ended; ranks 0, 1 and 2 wait in all_reduce #1234 for it",
                                   (3,), "skipped")


def test_ranks_to_blame_for_the_same_thing_are_named_together():
    ranks = [waiting(0, 9), evidence(1, progress(1, "data")), waiting(2, 9), evidence(3, progress(3, "data"))]
    assert judged(ranks, NOW) == Judged("ranks 1 and 3 are in DataLoader.__next__ (waiting for data for 94 s); "
                                   "ranks 0 and 2 wait in all_reduce #9 for them", (1, 3), "data")


def test_many_ranks_to_blame_are_summed_up_past_three_kinds():
    ranks = [waiting(0, 9), evidence(1, progress(1, "data")), evidence(2, progress(2), running=False),
             evidence(3, None), evidence(4, progress(4, "data", since=1090)), evidence(5, None, running=False)]
    assert judged(ranks, NOW) == Judged("rank 1 is in DataLoader.__next__ (waiting for data for 94 s); "
                                   "ranks 2 and 5 have ended; rank 3 reports no progress; rank 4 is elsewhere; "
                                   "rank 0 waits in all_reduce #9 for them", (1, 2, 3, 4, 5), "data")


def test_long_runs_of_ranks_are_written_as_a_range():
    ranks = [waiting(rank, 3) for rank in range(8) if rank != 6] + [evidence(6, progress(6), running=False)]
    assert judged(ranks, NOW).sentence == "rank 6 has ended; ranks 0-5 and 7 wait in all_reduce #3 for it"


# --- no rank waits for another ---

def test_a_single_rank_stuck_in_time_sleep_is_in_native_code(stuck):
    stack = stuck("load_batch")
    assert judged([evidence(0, progress(0), stack=stack)], NOW) == Judged(
        f"rank 0 is in native code, called from `load_batch` at train.py:{line_of('time.sleep(60)')} "
        "(its GIL is free)", (0,), "native")


def test_a_single_rank_waiting_for_data_is_named():
    assert judged([evidence(0, progress(0, "data", since=NOW - 4.5))], NOW) == Judged(
        "rank 0 is in DataLoader.__next__ (waiting for data for 4.5 s)", (0,), "data")


def test_independent_ranks_are_each_named_with_what_they_do(stuck):
    library = parse_stack(stuck("wait_for_peers"))
    ranks = [evidence(0, progress(0, "data", since=NOW - 210)), evidence(1, progress(1, since=NOW - 9000),
                                                                         frames=library),
             evidence(2, progress(2), running=False)]
    assert judged(ranks, NOW) == Judged(
        f"rank 0 is in DataLoader.__next__ (waiting for data for 3.5 min); rank 1 is computing in `wait` at "
        f"train.py:{line_of('peers.wait(60)')} (no progress for 2.5 h); rank 2 has ended", (0, 1), "data")


def test_ranks_without_progress_records_are_named_with_what_is_known():
    assert judged([evidence(0, None), evidence(1, None)], NOW) == Judged("ranks 0 and 1 report no progress", (), "unknown")
    assert judged([evidence(0, None, frames=[("/x/main.py", 7, "<module>")])], NOW) == Judged(
        "rank 0 reports no progress; it is in main.py:7", (), "unknown")
    assert judged([], NOW) == Judged("no rank gave any evidence", (), "unknown")


def test_ranks_that_all_ended_are_named():
    assert judged([evidence(0, progress(0), running=False), evidence(1, None, running=False)], NOW) == Judged(
        "ranks 0 and 1 have ended, yet the call did not end", (), "unknown")


# --- the flight recorder's waits, where no Python call shows one (DDP) ---

def fr(seq: int, state: str, created_s: float = 1000.0, op: str = "nccl:all_reduce") -> dict:
    return {"seq": seq, "op": op, "state": state, "created_ns": int(created_s * 1e9), "group": "default_pg"}


def test_a_rank_that_never_started_the_flight_recorders_collective_is_to_blame(stuck):
    """Gloo's entries stay "scheduled": a collective some rank never started cannot have completed."""
    ranks = [evidence(0, progress(0), stack=stuck("load_batch"), collectives=(fr(56, "scheduled"),
                                                                            fr(57, "scheduled"))),
             evidence(1, progress(1, "data"), collectives=(fr(56, "scheduled"),))]
    assert judged(ranks, NOW) == Judged("rank 1 is in DataLoader.__next__ (waiting for data for 94 s); "
                                   "rank 0 waits in all_reduce #57 for it", (1,), "data")


def test_every_rank_started_in_the_flight_recorder_blames_the_collective():
    ranks = [evidence(0, progress(0), collectives=(fr(57, "started", 1000.0),)),
             evidence(1, progress(1), collectives=(fr(57, "started", 1004.0),))]
    assert judged(ranks, NOW) == Judged(
        "every rank waits in all_reduce #57 (for 90 s): the collective itself does not complete", (), "collective")
    # Entries that stay "scheduled" (gloo's) tell no wait where every rank started the collective.
    scheduled = [evidence(r.rank, r.progress, collectives=(fr(57, "scheduled"),)) for r in ranks]
    assert judged(scheduled, NOW).cause == "compute"
