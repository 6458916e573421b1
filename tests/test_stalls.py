"""Stalls planted in real calls (two ranks, gloo on CPUs): each one is reported once, after the
stall timeout and within a few seconds more, naming the rank to blame and the cause
(_launch/stall_watch.py, forensics.py, verdict.py; docs/hangs.md). on_stall is a function that
keeps the report and raises, which stops the call at once, so that each test ends in seconds."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fanrun
from fanrun import distributed
from fanrun._launch.records import RunRecord
from fanrun._launch.stall_report import REPORT_JSON, REPORT_TEXT
from cluster_stalls import check_straggler
from processes import alive, processes_of_runs_under

# Short, so that each test ends in seconds. The ranks' start-up can outlast it on the loaded 2-core
# machine: importing torch and joining the process group (then a barrier, the first progress),
# and torch._dynamo's import at the first optimizer, each took 2 to 8 s there. Such a start-up is
# reported too, and Reports lets the call go on after it.
STALL_TIMEOUT_S = 6.0
# "abort" stops the call at its first report, a start-up's too: a timeout above the start-up.
ABORT_STALL_TIMEOUT_S = 12.0
# After the stall timeout, the report takes the evidence's gathering (forensics.WAIT_S at most, all
# of it for a rank that cannot answer) and the watch's next read: this is a loaded machine's bound.
REPORTED_WITHIN_S = STALL_TIMEOUT_S + 10.0
# A planted stall's length where it ends by itself, long past its report; a call that never
# reports it ends anyway, by the call's own timeout.
STALL_S = 60.0
CALL_TIMEOUT_S = 90.0
AT_STEP = 4  # the step of rank 1 that stalls: the ranks have made progress by then
STEPS = 8
PLANT_MARK = "planted"  # the file where the stalled rank writes when its stall began


class Stopped(Exception):
    """Raised by on_stall to stop the call once its report has come."""


class Reports:
    """on_stall: keeps each report with the time it came; the first one once the stall has been
    planted (in `marks`) stops the call. One before it lets the call go on."""

    def __init__(self, marks: Path) -> None:
        self.marks = marks
        self.got: list[tuple[float, object]] = []
        self.before: list[object] = []  # the reports that came before the stall was planted

    def __call__(self, report) -> None:
        if not (self.marks / PLANT_MARK).exists():
            self.before.append(report)
            return
        self.got.append((time.time(), report))
        raise Stopped


def train(plant: str, marks: str, stall_s: float = STALL_S, optimize: bool = True) -> int:
    """Steps of a small model with one all_reduce each; rank 1 plants `plant` at AT_STEP. Returns
    the rank's pid. `optimize`: each step ends with an optimizer's (a call whose ranks are to be kept
    does without: torch keeps the gloo group alive past destroy_process_group once an optimizer
    is made, and fanrun then ends the ranks)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    # Progress as soon as the group is up: the optimizer's imports that follow are a quiet of their own.
    dist.barrier()
    planted = plant if dist.get_rank() == 1 else ""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if optimize else None
    loader = torch.utils.data.DataLoader(Samples(planted == "data", marks, stall_s), batch_size=1)
    for step, batch in enumerate(loader):
        model(batch).sum().backward()
        total = torch.ones(1)
        if step == AT_STEP and planted and planted != "data":
            mark(marks)
            PLANTS[planted](total, stall_s)
        dist.all_reduce(total)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        if step == STEPS:
            break
    dist.destroy_process_group()  # a kept rank stays for the next call only without one
    return os.getpid()


class Samples:
    """A Dataset whose AT_STEP-th sample takes `stall_s` to come, where `slow`."""

    def __init__(self, slow: bool, marks: str, stall_s: float) -> None:
        self.slow, self.marks, self.stall_s = slow, marks, stall_s

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int):
        import torch

        if self.slow and index == AT_STEP:
            mark(self.marks)
            time.sleep(self.stall_s)
        return torch.ones(4)


def mark(marks: str) -> None:
    Path(marks, PLANT_MARK).write_text(repr(time.time()))


def broadcast_instead(total, stall_s: float) -> None:
    import torch.distributed as dist

    dist.broadcast(total, 0)  # its peer calls all_reduce


def wait_in_own_function(total, stall_s: float) -> None:
    threading.Event().wait(stall_s)  # and then skips this step's all_reduce


def native_holding_the_gil(total, stall_s: float) -> None:
    # A read of a pipe that nobody writes, through PyDLL, which keeps the GIL: it waits for ever,
    # and a signal's handler (faulthandler's, set with SA_RESTART) restarts it.
    read_end, _write_end = os.pipe()
    ctypes.PyDLL(None).read(read_end, ctypes.create_string_buffer(1), 1)


def native_releasing_the_gil(total, stall_s: float) -> None:
    libc = ctypes.CDLL(None)  # releases the GIL around each call
    for _ in range(int(stall_s)):
        libc.sleep(1)


PLANTS = {"mismatch": broadcast_instead, "skipped": wait_in_own_function, "native-gil": native_holding_the_gil,
          "native": native_releasing_the_gil}

# The collective rank 0 waits in while rank 1 stalls: after the barrier, one all_reduce per step.
WAITED_IN = AT_STEP + 2
# Each planted stall: the ranks to blame, the cause, and words its sentence must hold.
EXPECTED = {
    "data": ((1,), "data", ["rank 1", "DataLoader.__next__", f"rank 0 waits in all_reduce #{WAITED_IN}"]),
    # Two ranks, one in each: neither is the majority, so both are to blame.
    "mismatch": ((0, 1), "mismatch", [f"collective mismatch at #{WAITED_IN}", "rank 0 in all_reduce",
                                      "rank 1 in broadcast"]),
    "skipped": ((1,), "skipped", [f"rank 1 never entered collective #{WAITED_IN}", "test_stalls.py:",
                                  f"rank 0 waits in all_reduce #{WAITED_IN}"]),
    "native-gil": ((1,), "native-gil", ["rank 1", "holds the GIL", "native_holding_the_gil"]),
    "native": ((1,), "native", ["rank 1", "native code", "native_releasing_the_gil"]),
}


def watched(**options):
    return distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="logs",
                       timeout=CALL_TIMEOUT_S, **{"stall_timeout": STALL_TIMEOUT_S, **options})


def planted_at(marks: Path, reports=()) -> float:
    path = marks / PLANT_MARK
    assert path.exists(), f"rank 1 never planted its stall; reports: {[str(report) for report in reports]}"
    return float(path.read_text())


def check_report(report, case: str, stalled_at: float, reported_at: float, timeout: float = STALL_TIMEOUT_S) -> None:
    culprits, cause, words = EXPECTED[case]
    assert (report.culprits, report.verdict.cause) == (culprits, cause), report.sentence
    for word in words:
        assert word in report.sentence, f"{word!r} is not in the verdict: {report.sentence}"
    # Not before the timeout (its quiet began with the last step before the stall), and soon after.
    assert timeout - 1.0 <= reported_at - stalled_at <= timeout + REPORTED_WITHIN_S - STALL_TIMEOUT_S, (
        reported_at - stalled_at, report.sentence)
    assert [evidence.rank for evidence in report.ranks] == [0, 1]


def the_one_report(reports: Reports, marks: Path):
    """The planted stall's report, and when the stall began and the report came. A report before it
    may only be of a start-up that outlasted the stall timeout: no rank had taken a batch yet."""
    stalled_at = planted_at(marks, [report for _, report in reports.got] + reports.before)
    for report in reports.before:
        assert all(rank.progress is None or rank.progress.batches == 0 for rank in report.ranks), report.to_text()
    assert len(reports.got) == 1, [(at - stalled_at, report.sentence) for at, report in reports.got]
    (reported_at, report), = reports.got
    return report, stalled_at, reported_at


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_planted_stall_is_reported_once_naming_its_culprit_and_cause(case, tmp_path, capfd):
    reports = Reports(tmp_path)
    with pytest.raises(Stopped):
        watched(on_stall=reports)(train).distributed(case, str(tmp_path))
    report, stalled_at, reported_at = the_one_report(reports, tmp_path)
    check_report(report, case, stalled_at, reported_at)
    err = capfd.readouterr().err
    assert f"fanrun: run {report.run_id} stalled: {report.sentence} (no progress for " in err, err[-3000:]
    assert f"fanrun stacks {report.run_id} shows every rank's evidence" in err
    check_kept_files(report, case)


def check_kept_files(report, case: str) -> None:
    """The report is in the run directory and the run's record, as JSON and as text."""
    record = RunRecord.find(report.run_id)
    found = record.run_directory()
    assert found is not None
    directory, dir_fd = found
    os.close(dir_fd)
    for data in ((directory / REPORT_JSON).read_bytes(), record.read_bytes(REPORT_JSON)):
        kept = json.loads(data)
        assert kept["verdict"] == {"sentence": report.sentence, "culprits": list(report.culprits),
                                   "cause": report.verdict.cause}
        assert kept["run_id"] == report.run_id and len(kept["ranks"]) == 2
    text = (directory / REPORT_TEXT).read_text()
    assert text == record.read_bytes(REPORT_TEXT).decode() == report.to_text()
    assert text.startswith(f"run {report.run_id}: stall: {report.sentence}\n")
    # Every rank's threads, as faulthandler dumped them: rank 1's planted frame among them.
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert text.count("(most recent call first)") >= 2
    planted = "__getitem__" if case == "data" else PLANTS[case].__name__
    assert f"in {planted}" in text, text[-3000:]


def test_abort_raises_rank_stalled_error_naming_the_culprit_and_leaves_no_rank_running(tmp_path, runs_dir):
    with pytest.raises(fanrun.RankStalledError) as raised:
        watched(on_stall="abort", stall_timeout=ABORT_STALL_TIMEOUT_S)(train).distributed("data", str(tmp_path))
    error = raised.value
    check_report(error.report, "data", planted_at(tmp_path, [error.report]), error.report.at, ABORT_STALL_TIMEOUT_S)
    assert error.culprits == (1,)
    assert error.report.sentence in str(error) and "on_stall='abort' stopped it" in str(error)
    pids = [evidence.progress.pid for evidence in error.report.ranks]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert [pid for pid in pids if alive(pid)] == []
    assert processes_of_runs_under(str(runs_dir)) == []


def test_kept_ranks_report_a_later_calls_stall_as_fresh_ones_do(tmp_path):
    kept = watched(on_stall=(reports := Reports(tmp_path)), keep_alive=True)(train)
    try:
        pids = kept.distributed("", str(tmp_path), optimize=False)  # no stall: the ranks stay for the next call
        with pytest.raises(Stopped):
            kept.distributed("data", str(tmp_path))
    finally:
        fanrun.cooldown()
    report, stalled_at, reported_at = the_one_report(reports, tmp_path)
    check_report(report, "data", stalled_at, reported_at)
    # The second call's records are the kept ranks' own, written afresh.
    assert [evidence.progress.pid for evidence in report.ranks] == pids


def test_warm_ranks_report_a_stall_as_fresh_ones_do(tmp_path):
    try:
        with pytest.raises(Stopped):
            watched(on_stall=(reports := Reports(tmp_path)), warm=True)(train).distributed("skipped", str(tmp_path))
    finally:
        fanrun.cooldown()
    report, stalled_at, reported_at = the_one_report(reports, tmp_path)
    check_report(report, "skipped", stalled_at, reported_at)


def test_a_detached_run_keeps_its_report_in_its_record_and_goes_on(tmp_path):
    # A stall that ends by itself, after its report: on_stall="report" lets the run go on to its end.
    stall_s = STALL_TIMEOUT_S + 5.0
    run = watched(on_stall="report", detach=True)(train).distributed("data", str(tmp_path), stall_s)
    pids = run.result(timeout=CALL_TIMEOUT_S)
    assert len(pids) == 2 and run.status == "FINISHED"
    record = RunRecord.find(run.id)
    kept = json.loads(record.read_bytes(REPORT_JSON))
    assert (tuple(kept["verdict"]["culprits"]), kept["verdict"]["cause"]) == ((1,), "data"), kept["verdict"]
    assert "DataLoader.__next__" in kept["verdict"]["sentence"]
    stalled_at = planted_at(tmp_path)
    assert STALL_TIMEOUT_S - 1.0 <= kept["at"] - stalled_at <= REPORTED_WITHIN_S
    assert [rank["progress"]["pid"] for rank in kept["ranks"]] == pids
    assert f"fanrun: run {run.id} stalled: {kept['verdict']['sentence']} (no progress for " in run.logs()
    text = record.read_bytes(REPORT_TEXT).decode()
    assert text.startswith(f"run {run.id}: stall: {kept['verdict']['sentence']}\n")
    # `fanrun stacks ID` prints the last report after the run's end too.
    shown = subprocess.run([sys.executable, "-m", "fanrun", "stacks", run.id], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"run {run.id}: stall: {kept['verdict']['sentence']}\n"), shown.stdout[:2000]
    assert "--- rank 1 ---" in shown.stdout and "in __getitem__" in shown.stdout


def slow_steps(steps: int, step_s: float, how: str) -> int:
    """Steps of a small model; rank 1 computes three times as long per step as rank 0. The gradients
    are all-reduced by DDP (how="ddp": no Python collective shows it), or by one all_reduce a step."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    if how == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        time.sleep(step_s * (3 if rank == 1 else 1))
        model(torch.ones(4)).sum().backward()  # under DDP rank 0 waits here for rank 1
        if how == "all_reduce":
            dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1: its own step is as long, in waiting
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
    return rank


@pytest.mark.parametrize("how", ["all_reduce", "ddp"])
def test_a_rank_three_times_slower_per_step_is_flagged_a_straggler_for_its_compute(how, tmp_path, capfd):
    """The call's own stall watch flags the slow rank alone, for its compute, and says so once; under
    DDP from the ranks' flight recorders, which tell how long rank 0 waits for rank 1."""
    distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="logs",
                on_stall="report", timeout=CALL_TIMEOUT_S)(slow_steps).distributed(100, 0.05, how)
    check_straggler(capfd.readouterr().err, 1)
