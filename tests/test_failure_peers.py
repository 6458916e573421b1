"""A failure names its first cause, and says what the other ranks were doing then: a peer waiting
in a collective fails because of the first rank, and the caller is told so."""

from __future__ import annotations

import pytest

import fanrun


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


def test_a_call_without_the_watch_adds_no_note():
    call = fanrun.distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="quiet",
                              on_stall=None)(_train)
    with pytest.raises(ValueError) as error:
        call.distributed("raise")
    assert not any("when rank 1 failed" in note for note in getattr(error.value, "__notes__", []))
