"""A rank's progress record (_rank/progress.py writes it, in the contract's PROGRESS_FORMAT) as the
caller's side reads it: the stall watch (_launch/stall_watch.py), tracking's step times
(_tracking/rank_steps.py) and the goodput ledger (_launch/goodput.py) read it through this one reader.
Beside the records, the stall watch keeps what the ranks' flight recorders tell of their waits in
collectives (COLLECTIVE_WAITS_NAME), which tracking's step times take too."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

from .._rank import contract

_FORMAT = struct.Struct(contract.PROGRESS_FORMAT)
STATES = {contract.STATE_COMPUTE: "compute", contract.STATE_DATA: "data", contract.STATE_COLLECTIVE: "collective"}
# In the run's directory: {rank: seconds}, each rank's wait per step for the last rank to start its
# collectives, from the flight recorders (straggler.py), where no Python collective shows it (DDP).
COLLECTIVE_WAITS_NAME = "collective-waits.json"


def comm_per_step_s(progress: RankProgress, collective_wait_s: float) -> float:
    """The rank's time in collectives in its last step: its Python collectives' or, where more, its
    wait for the last rank as the flight recorders tell it; never more than its step holds besides data."""
    waited = max(progress.step_comm_s, collective_wait_s)
    return min(waited, max(progress.step_s - progress.step_data_s, 0.0))


def encode_collective_waits(waits: dict[int, float]) -> bytes:
    return json.dumps({str(rank): seconds for rank, seconds in waits.items()}).encode()


def read_collective_waits(run_dir: Path) -> dict[int, float]:
    """{} where the stall watch has written none (one rank, no flight recorder, not watched)."""
    try:
        waits = json.loads((run_dir / COLLECTIVE_WAITS_NAME).read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(waits, dict):
        return {}
    return {int(rank): float(seconds) for rank, seconds in waits.items()
            if str(rank).isdigit() and isinstance(seconds, (int, float))}


@dataclasses.dataclass(frozen=True)
class RankProgress:
    """One read of a rank's progress record: times are time.time()'s."""

    rank: int
    state: str  # "compute", "data" (in a DataLoader's __next__) or "collective" (in `op`, the `collectives`-th)
    pid: int
    steps: int  # optimizer steps
    batches: int  # DataLoader batches fetched
    collectives: int  # collectives entered through torch.distributed's Python functions
    state_since: float
    progress_at: float  # the last step, batch or collective's end; 0 before any
    step_at: float  # the last step's end; 0 before any
    step_s: float  # the last step's length, from the step before it; 0 before two steps
    step_data_s: float  # of it, waiting for data
    step_comm_s: float  # of it, in collectives
    data_s: float  # summed over the call
    comm_s: float
    op: str  # the current or last collective
    # The call's marks for its goodput ledger (_launch/goodput.py); 0 where not reached yet.
    began_at: float = 0.0  # the function began
    torch_at: float = 0.0  # torch's import ended, where this call imported it
    ready_at: float = 0.0  # its first collective, or else its first step, ended
    ready_data_s: float = 0.0  # data_s by then
    ended_at: float = 0.0  # the function returned
    failed_at: float = 0.0  # the function raised
    checkpoint_s: float = 0.0  # the training thread held by saves of torch.distributed.checkpoint
    checkpoint_step: int = 0  # `steps` when the last completed save began
    checkpoints: int = 0  # saves completed

    @classmethod
    def read(cls, path: Path, rank: int) -> RankProgress | None:
        """The record in `path`; None where there is none yet, or it is not one."""
        try:
            with open(path, "rb") as file:
                data = file.read(_FORMAT.size)
        except OSError:
            return None
        if len(data) != _FORMAT.size:
            return None
        values = dict(zip(contract.PROGRESS_FIELDS, _FORMAT.unpack(data)))
        if values.pop("magic") != contract.PROGRESS_MAGIC:
            return None
        values["state"] = STATES.get(values["state"], "compute")
        values["op"] = values["op"].rstrip(b"\0").decode("ascii", "replace")
        return cls(rank=rank, **values)
