"""Failures planted in DDP training, and what the caller must be told of them: shared by the
local tests (test_failure_peers.py) and the cluster ones (tests/slurm)."""

from __future__ import annotations

from pathlib import Path


def ddp_until_rank_1_raises(out_dir: str):
    import json
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    said = os.path.join(out_dir, "next_seq")
    for step in range(20):
        loss = model(torch.ones(8, 4)).sum()
        if step == 5:
            if dist.get_rank() == 1:
                # Once rank 0 is in its backward, whose all-reduce of a tiny model starts at once.
                while not os.path.exists(said):
                    time.sleep(0.01)
                time.sleep(1.0)
                raise ValueError("bad batch")
            # The all-reduce that rank 0's backward starts now is the next one of its recorder.
            entries = json.loads(c10d._dump_fr_trace_json(includeCollectives=True))["entries"]
            with open(said + ".tmp", "w") as file:
                file.write(str(entries[-1]["collective_seq_id"] + 1))
            os.replace(said + ".tmp", said)
        loss.backward()
    return dist.get_rank()


def check_ddp_note(error: BaseException, out_dir: Path) -> None:
    """The note names rank 0 as waiting in the all-reduce that its recorder started at step 5, by
    its sequence number in the default group (named "0" by the recorder)."""
    seq = (out_dir / "next_seq").read_text()
    notes = getattr(error, "__notes__", [])
    assert (f"fanrun: when rank 1 failed, rank 0 was waiting in all_reduce #{seq} of group 0: their errors follow "
            "from its failure.") in notes, notes
