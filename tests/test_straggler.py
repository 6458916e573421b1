"""Stragglers (_launch/straggler.py): a rank slower than the others per step is flagged once it has
been so for five steps in a row, with the reason; two real ranks on gloo, one three times slower,
with their real progress records and flight recorders."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fanrun._launch.stall_report import RankProgress
from fanrun._launch.straggler import Straggler, StragglerWatch
from fanrun._rank import contract


def record(rank: int, steps: int, step_s: float, data_s: float = 0.0, comm_s: float = 0.0) -> RankProgress:
    return RankProgress(rank=rank, state="compute", pid=1000 + rank, steps=steps, batches=steps, collectives=steps,
                        state_since=0.0, progress_at=0.0, step_at=0.0, step_s=step_s, step_data_s=data_s,
                        step_comm_s=comm_s, data_s=0.0, comm_s=0.0, op="all_reduce")


def lockstep(slow_rank: int, world: int, steps: int, own_s: float = 0.1, slow_own_s: float = 0.3,
             slow_data_s: float = 0.0) -> list[RankProgress]:
    """Every rank's step lasts as long as the slowest one's: the others wait for it in a collective."""
    step_s = slow_own_s + 0.01
    return [record(rank, steps, step_s, data_s=slow_data_s if rank == slow_rank else 0.0,
                   comm_s=step_s - (slow_own_s if rank == slow_rank else own_s)) for rank in range(world)]


def feed(watch: StragglerWatch, reads: list[list[RankProgress]]) -> list[list[Straggler]]:
    return [watch.update(read, now=float(index)) for index, read in enumerate(reads)]


def test_a_rank_three_times_slower_per_step_is_flagged_after_five_steps():
    watch = StragglerWatch()
    flagged = feed(watch, [lockstep(2, 4, steps) for steps in range(2, 9)])
    assert flagged[:4] == [[], [], [], []]
    assert flagged[4] == [Straggler(2, "compute", pytest.approx(3.0), 5)]
    assert flagged[6] == [Straggler(2, "compute", pytest.approx(3.0), 7)]


def test_with_two_ranks_the_one_that_waits_is_not_flagged_for_its_collectives():
    """The fast rank's collectives last long because it waits in them for the slow one."""
    watch = StragglerWatch()
    assert feed(watch, [lockstep(1, 2, steps) for steps in range(2, 9)])[-1] == [
        Straggler(1, "compute", pytest.approx(3.0), 7)]


def test_a_rank_slow_for_its_data_is_flagged_for_its_data():
    watch = StragglerWatch()
    flagged = feed(watch, [lockstep(0, 3, steps, slow_data_s=0.15) for steps in range(2, 7)])
    assert flagged[-1] == [Straggler(0, "data", pytest.approx(3.0), 5)]


def test_a_rank_whose_collectives_alone_are_long_is_flagged_for_communication():
    watch = StragglerWatch()
    reads = [[record(rank, steps, 0.5 if rank == 1 else 0.2, comm_s=0.4 if rank == 1 else 0.1) for rank in range(3)]
             for steps in range(2, 7)]
    assert feed(watch, reads)[-1] == [Straggler(1, "communication", pytest.approx(4.0), 5)]


def test_a_rank_back_within_the_margin_is_unflagged_and_starts_over():
    watch = StragglerWatch()
    feed(watch, [lockstep(1, 3, steps) for steps in range(2, 7)])
    assert [s.rank for s in watch.stragglers()] == [1]
    assert watch.update(lockstep(1, 3, 7, slow_own_s=0.14), now=7.0) == []  # 1.4 times: within the margin
    assert feed(watch, [lockstep(1, 3, steps) for steps in range(8, 12)])[-1] == []  # four in a row: not yet
    assert watch.update(lockstep(1, 3, 12), now=12.0) == [Straggler(1, "compute", pytest.approx(3.0), 5)]


def test_a_read_without_new_steps_does_not_count_and_many_new_steps_count_once():
    watch = StragglerWatch()
    feed(watch, [lockstep(1, 3, steps) for steps in (2, 3, 4, 5)])
    assert watch.update(lockstep(1, 3, 5), now=5.0) == []  # no new step
    assert watch.update([None, None, None], now=6.0) == []  # not read: the last reads stand
    assert watch.update(lockstep(1, 3, 40), now=7.0) == [Straggler(1, "compute", pytest.approx(3.0), 5)]


def test_a_single_rank_is_never_a_straggler():
    watch = StragglerWatch()
    assert feed(watch, [[record(0, steps, 5.0)] for steps in range(2, 10)])[-1] == []


def test_the_panel_words_and_metrics_of_a_rank():
    watch = StragglerWatch()
    watch.update([record(0, 1, 0.0), record(1, 0, 0.0)], now=0.0)
    assert (watch.row_words(0), watch.metrics(0), watch.row_words(5)) == ("", {}, "")
    watch.update([record(0, 2, 0.21, data_s=0.0105, comm_s=0.084), record(1, 2, 0.05, comm_s=0.0), None], now=1.0)
    assert watch.row_words(0) == "step 0.21 s · data 5% · comm 40%"
    assert watch.row_words(1) == "step 50 ms · data 0% · comm 0%"
    assert watch.metrics(0) == {"step_time_s": 0.21, "data_wait_fraction": pytest.approx(0.05),
                                "comm_wait_fraction": pytest.approx(0.4)}
    watch.update([record(0, 3, 150.0, comm_s=3.0)], now=2.0)
    assert watch.row_words(0) == "step 2.5 min · data 0% · comm 2%"


# --- lateness from the flight recorders (DDP's all-reduces are no Python call) ---

def entries(seqs: range, late_rank: int, rank: int, late_s: float, group: str = "default_pg") -> list[dict]:
    return [{"seq": seq, "op": "gloo:all_reduce", "state": "scheduled", "group": group,
             "created_ns": int((seq * 1.0 + (late_s if rank == late_rank else 0.001 * rank)) * 1e9)} for seq in seqs]


def test_a_rank_that_starts_every_collective_last_is_flagged_under_ddp():
    """Every rank's step lasts 0.3 s and none is in a Python collective; rank 1 starts each
    all-reduce 0.2 s after the others, whose own time is so 0.1 s: three times less."""
    watch = StragglerWatch()
    watch.update([record(rank, 2, 0.3) for rank in range(3)], now=0.0)
    assert watch.stragglers() == []
    flagged = [watch.update_collectives({rank: entries(range(2 * call + 1, 2 * call + 3), 1, rank, 0.2)
                                         for rank in range(3)}) for call in range(6)]
    assert flagged[3] == []
    assert flagged[4] == [Straggler(1, "compute", pytest.approx(3.0), 5)]
    assert watch.update_collectives({rank: entries(range(13, 15), 1, rank, 0.01) for rank in range(3)}) == []


def ddp_steps(first_step: int, steps: int, rank: int) -> list[dict]:
    """Two gradient all-reduces a step, each step 1 s apart: rank 1 starts the first 0.1 s and the
    second 0.2 s after the others, who then wait 0.2 s for it at their step's end."""
    out = []
    for step in range(first_step, first_step + steps):
        for bucket in range(2):
            seq = 2 * step + bucket + 1
            late = 0.1 * (bucket + 1) if rank == 1 else 0.0
            out.append({"seq": seq, "op": "gloo:all_reduce", "state": "scheduled", "group": "0",
                        "created_ns": int((step + 0.05 * bucket + late) * 1e9)})
    return out


def test_under_ddp_each_ranks_wait_for_the_last_one_is_its_share_in_collectives():
    watch = StragglerWatch()
    watch.update([record(rank, 2, 0.3) for rank in range(3)], now=0.0)
    watch.update_collectives({rank: ddp_steps(0, 2, rank) for rank in range(3)})  # the steps so far: a baseline
    assert watch.metrics(0)["comm_wait_fraction"] == 0.0
    flagged = []
    for read in range(1, 7):
        flagged = watch.update([record(rank, 2 + 3 * read, 0.3) for rank in range(3)], now=float(read))
        watch.update_collectives({rank: ddp_steps(2 + 3 * (read - 1), 3, rank) for rank in range(3)})
    waits = watch.collective_waits()
    assert waits[0] == pytest.approx(0.2) and waits[2] == pytest.approx(0.2) and waits[1] == pytest.approx(0.0)
    assert watch.row_words(0) == "step 0.30 s · data 0% · comm 67%"
    assert watch.row_words(1) == "step 0.30 s · data 0% · comm 0%"
    # Its own time is its whole step, the others' a third of theirs: rank 1 is flagged by its steps too.
    assert flagged == [Straggler(1, "compute", pytest.approx(3.0), 5)]


def test_a_collective_that_the_late_rank_has_not_started_waits_for_the_next_read():
    watch = StragglerWatch()
    watch.update([record(rank, 2, 0.3) for rank in range(2)], now=0.0)
    for call in range(4):
        watch.update_collectives({rank: entries(range(call + 1, call + 2), 1, rank, 0.2) for rank in range(2)})
    # Rank 0 started #5 and #6, rank 1 neither yet: nothing new to judge, the streak stands.
    assert watch.update_collectives({0: entries(range(5, 7), 1, 0, 0.2), 1: entries(range(3, 5), 1, 1, 0.2)}) == []
    assert watch.update_collectives({0: entries(range(5, 7), 1, 0, 0.2), 1: entries(range(5, 6), 1, 1, 0.2)}) == [
        Straggler(1, "compute", pytest.approx(3.0), 5)]


def test_ranks_last_by_turns_or_in_unnamed_groups_are_not_flagged():
    watch = StragglerWatch()
    watch.update([record(rank, 2, 0.3) for rank in range(2)], now=0.0)
    for call in range(8):
        assert watch.update_collectives({rank: entries(range(call + 1, call + 2), call % 2, rank, 0.2)
                                         for rank in range(2)}) == []
    for call in range(8):
        assert watch.update_collectives({rank: entries(range(call + 1, call + 2), 1, rank, 0.2, "undefined")
                                         for rank in range(2)}) == []



def test_a_read_of_the_same_collectives_again_does_not_count():
    watch = StragglerWatch()
    watch.update([record(rank, 2, 0.3) for rank in range(2)], now=0.0)
    for _ in range(6):
        assert watch.update_collectives({rank: entries(range(1, 3), 1, rank, 0.2) for rank in range(2)}) == []


def test_ranks_each_last_in_half_of_the_collectives_are_not_flagged():
    """In every read, rank 0 starts two of the four collectives last, rank 1 the other two."""
    watch = StragglerWatch()
    watch.update([record(rank, 2, 0.3) for rank in range(2)], now=0.0)
    for call in range(6):
        seqs = range(4 * call + 1, 4 * call + 5)
        read = {rank: [entry for seq in seqs for entry in entries(range(seq, seq + 1), seq % 2, rank, 0.2)]
                for rank in range(2)}
        assert watch.update_collectives(read) == []

# --- two real ranks on gloo ---

RANK = textwrap.dedent("""\
    import json, sys, time
    from fanrun._rank import progress
    run_dir, rank, store, ddp = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "ddp"
    progress.install(run_dir, rank)
    import torch, torch.distributed as dist
    from torch.optim import optimizer as optimizer_module
    if not optimizer_module._global_optimizer_post_hooks:  # see test_progress_counts_optimizer_steps
        optimizer_module.register_optimizer_step_post_hook(progress._stepped)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = torch.nn.Linear(2, 2)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(12):
        time.sleep(0.3 if rank == 1 else 0.1)  # its own work: rank 1 three times as long
        model(torch.ones(1, 2)).sum().backward()  # under DDP, the gradients' all-reduce
        if not ddp:
            dist.all_reduce(torch.ones(1))
        optimizer.step()
        print(json.dumps(progress._flight_recorder()), flush=True)
    dist.destroy_process_group()
    """)


def run_two_ranks(tmp_path: Path, mode: str) -> tuple[StragglerWatch, list[list[Straggler]], list[list[Straggler]]]:
    """Two ranks, rank 1 three times slower per step; after each step, their records and flight
    recorders are read and fed to two watches, one of them given the records alone. The watch
    given both, then after each read the stragglers of the one given the records, and of the other."""
    script, run_dir = tmp_path / "rank.py", tmp_path / "run"
    script.write_text(RANK)
    run_dir.mkdir()
    source = str(Path(contract.__file__).parents[2])
    environment = {**os.environ, "TORCH_FR_BUFFER_SIZE": "64",
                   "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, str(script), str(run_dir), str(rank), str(tmp_path / "store"), mode],
                              stdout=subprocess.PIPE, text=True, env=environment) for rank in range(2)]
    watch, records_only, by_records, by_both = StragglerWatch(), StragglerWatch(), [], []
    try:
        for step in range(12):
            recorded = {rank: json.loads(process.stdout.readline()) for rank, process in enumerate(ranks)}
            reads = [RankProgress.read(run_dir / contract.progress_name(rank), rank) for rank in range(2)]
            by_records.append(records_only.update(reads, now=float(step)))
            watch.update(reads, now=float(step))
            by_both.append(watch.update_collectives(recorded))
        for process in ranks:
            assert process.wait(timeout=120) == 0
    finally:
        for process in ranks:
            process.kill()
            process.wait()
            process.stdout.close()
    return watch, by_records, by_both


@pytest.mark.slow
def test_two_real_ranks_one_three_times_slower_per_step(tmp_path):
    """Each rank's own time is its step less its Python all-reduce, in which rank 0 waits for rank 1."""
    watch, by_records, by_both = run_two_ranks(tmp_path, "all_reduce")
    (slow,) = by_records[-1]
    assert (slow.rank, slow.reason, slow.steps >= 5) == (1, "compute", True)
    assert 1.5 < slow.ratio < 4.0
    assert all(straggler.rank == 1 for read in by_records + by_both for straggler in read)  # rank 0 never: it waits
    assert [straggler.rank for straggler in by_both[-1]] == [1]
    assert re.fullmatch(r"step [\d.]+ (ms|s) · data 0% · comm \d+%", watch.row_words(0))
    assert watch.metrics(0)["comm_wait_fraction"] > 0.4 > watch.metrics(1)["comm_wait_fraction"]


@pytest.mark.slow
def test_two_real_ranks_under_ddp_the_slow_one_is_told_by_its_flight_recorder(tmp_path):
    """Under DDP both steps last as long and no Python collective runs: the records alone blame no
    one; the flight recorder, in which rank 1 starts each gradient all-reduce last, names it, and
    tells how long rank 0 waits for it."""
    watch, by_records, by_both = run_two_ranks(tmp_path, "ddp")
    # Rank 0 waits for rank 1 in every gradient all-reduce: 0.2 s of its 0.3 s step.
    assert watch.metrics(0)["comm_wait_fraction"] > 0.4 > watch.metrics(1)["comm_wait_fraction"]
    assert by_records == [[]] * 12
    (slow,) = by_both[-1]
    assert (slow.rank, slow.reason, slow.steps >= 5) == (1, "compute", True)
    assert 1.5 < slow.ratio < 4.0
    assert all(straggler.rank == 1 for read in by_both for straggler in read)


def test_progress_counts_optimizer_steps(tmp_path):
    counted = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""\
        import sys
        from fanrun._rank import progress
        progress.install({str(tmp_path)!r}, 0)
        import torch
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        print(progress._record.values[3])
        """)], check=False, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(contract.__file__).parents[2]),
                                                          os.environ.get("PYTHONPATH", "")])})
    assert counted.returncode == 0, counted.stderr
    assert counted.stdout.split() == ["3"]
