"""A stall planted in a call over two nodes of two CPU ranks each, for the Slurm and Ray tests:
rank 2, on the second node, waits in its DataLoader for its fourth sample while its peers wait in
all_reduce for it. The watch on the caller must name it from the evidence of both nodes. And a
straggler under DDP: the rank on the second node computes three times as long per step, which
the caller learns from the flight recorders that each node's agent sends it."""

from __future__ import annotations

import re
import time
from pathlib import Path

PLANTED_RANK = 2  # the first rank of the second node
AT_SAMPLE = 3
STALL_S = 60.0  # long past the report: the call is stopped by on_stall, or ends by its own timeout
STALL_TIMEOUT_S = 8.0
# After the stall timeout: the watch's next read, the gathering from both nodes (their ranks'
# wait at most, and the way back) on a loaded 2-core machine.
REPORTED_WITHIN_S = STALL_TIMEOUT_S + 15.0
CALL_TIMEOUT_S = 120.0
PLANT_MARK = "planted"
# The barrier is the first collective and each sample's all_reduce one more: rank 2's peers wait in
# the one after its third sample's.
WAITED_IN = AT_SAMPLE + 2


class Stopped(Exception):
    """Raised by on_stall once the planted stall's report has come: the call stops at once."""


class Reports:
    """on_stall: a report before the stall is planted (a start-up that outlasted the stall
    timeout) lets the call go on; the first one after it is kept, and stops the call."""

    def __init__(self, marks: Path) -> None:
        self.marks = marks
        self.got: list[tuple[float, object]] = []
        self.before: list[object] = []

    def __call__(self, report) -> None:
        if not (self.marks / PLANT_MARK).exists():
            self.before.append(report)
            return
        self.got.append((time.time(), report))
        raise Stopped


class Samples:
    def __init__(self, slow: bool, marks: str) -> None:
        self.slow, self.marks = slow, marks

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int):
        import torch

        if self.slow and index == AT_SAMPLE:
            Path(self.marks, PLANT_MARK).write_text(repr(time.time()))
            time.sleep(STALL_S)
        return torch.ones(1)


def train_with_a_slow_loader(marks: str) -> int:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    for index, sample in enumerate(DataLoader(Samples(rank == PLANTED_RANK, marks), batch_size=1)):
        dist.all_reduce(sample)
        if index == AT_SAMPLE + 2:
            break
    dist.destroy_process_group()
    return rank


def check_report(reports: Reports, marks: Path) -> None:
    """One report after the stall, in time, blaming rank 2's DataLoader with every rank's evidence:
    the stacks and answers of the ranks of the second node came from its agent."""
    assert (marks / PLANT_MARK).exists(), [str(report) for report in reports.before]
    assert len(reports.got) == 1, [str(report) for _, report in reports.got]
    stalled_at = float((marks / PLANT_MARK).read_text())
    reported_at, report = reports.got[0]
    assert (report.culprits, report.verdict.cause) == ((PLANTED_RANK,), "data"), report.to_text()
    for words in (f"rank {PLANTED_RANK}", "DataLoader.__next__", f"wait in all_reduce #{WAITED_IN}"):
        assert words in report.sentence, report.sentence
    assert STALL_TIMEOUT_S - 1.0 <= reported_at - stalled_at <= REPORTED_WITHIN_S, report.sentence
    assert [rank.rank for rank in report.ranks] == [0, 1, 2, 3]
    for rank in report.ranks:
        assert rank.running and rank.answered and not rank.unasked, report.to_text()
        assert rank.progress is not None and rank.progress.batches >= AT_SAMPLE, report.to_text()
    assert "__getitem__" in report.ranks[PLANTED_RANK].stack, report.ranks[PLANTED_RANK].stack


def ddp_with_a_slow_rank(steps: int, step_s: float) -> int:
    """DDP steps of a small model; the last rank computes three times as long per step."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        time.sleep(step_s * (3 if rank == last else 1))
        model(torch.ones(4)).sum().backward()  # the others wait here for the last rank's gradients
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
    return rank


def check_straggler(stderr: str, rank: int) -> None:
    """The call said once that `rank`, and no other, straggles for its compute, about three times."""
    said = [line for line in stderr.splitlines() if "straggler" in line]
    assert len(said) == 1, said
    found = re.fullmatch(rf"fanrun: rank {rank} is a straggler: compute, ([\d.]+)x the others' step", said[0])
    assert found and 2.0 <= float(found[1]) <= 4.5, said
