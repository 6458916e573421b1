"""A failure names its first cause, and says what the other ranks were doing then: a peer waiting
in a collective fails because of the first rank, and the caller is told so."""

from __future__ import annotations

import time

import pytest

from failure_plants import check_ddp_note, ddp_until_rank_1_raises

import fanrun
from fanrun.backends.base import FAILURE_EVIDENCE_S


def _train(how: str):
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(20):
        if dist.get_rank() == 1 and step == 5:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("bad batch")
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


@pytest.mark.parametrize("how, raised", [("kill", fanrun.RankFailedError), ("raise", ValueError)])
def test_a_killed_or_raising_rank_is_the_cause_and_its_waiting_peer_is_named(how, raised):
    call = fanrun.distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="quiet")(_train)
    with pytest.raises(raised) as error:
        call.distributed(how)
    if how == "kill":
        assert error.value.rank == 1 and error.value.signal_name == "SIGKILL"
    else:
        assert "bad batch" in str(error.value)
    notes = getattr(error.value, "__notes__", [])
    assert "fanrun: when rank 1 failed, rank 0 was waiting in all_reduce #6: their errors follow from its failure." \
        in notes, notes


def test_a_peer_waiting_in_a_ddp_all_reduce_is_named_from_its_flight_recorder(tmp_path):
    """Rank 0 waits in the gradient all-reduce of its backward, which no Python call of
    torch.distributed shows, when rank 1 raises before its own: its flight recorder says so."""
    call = fanrun.distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="quiet")(ddp_until_rank_1_raises)
    with pytest.raises(ValueError, match="bad batch") as error:
        call.distributed(str(tmp_path))
    check_ddp_note(error.value, tmp_path)


def _fail_beside_a_held_gil():
    import ctypes
    import os
    import time

    if os.environ["RANK"] == "1":
        time.sleep(2.0)  # rank 0 is in its read by then
        raise ValueError("bad batch")
    # A read of a pipe that nobody writes, through PyDLL, which keeps the GIL: rank 0's
    # forensics thread can never answer.
    read_end, _write_end = os.pipe()
    ctypes.PyDLL(None).read(read_end, ctypes.create_string_buffer(1), 1)


def test_a_peer_that_cannot_answer_holds_the_failure_up_for_one_second_at_most():
    call = fanrun.distributed(num_accelerators=2, accelerator_type="CPU", tracking=False,
                              display="quiet")(_fail_beside_a_held_gil)
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad batch") as error:
        call.distributed()
    # rank 1's sleep, the second rank 0 gets to answer, and the starts and stops of a 2-core machine
    assert time.monotonic() - started < 2.0 + FAILURE_EVIDENCE_S + 3.0
    assert not any("when rank 1 failed" in note for note in getattr(error.value, "__notes__", []))


def test_a_call_without_the_watch_adds_no_note():
    call = fanrun.distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="quiet",
                              on_stall=None)(_train)
    with pytest.raises(ValueError) as error:
        call.distributed("raise")
    assert not any("when rank 1 failed" in note for note in getattr(error.value, "__notes__", []))
