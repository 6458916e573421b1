"""The run contract is defined once per language (src/fanrun/_rank/contract.py and
cpp/include/fanrun/run_contract.h), and the two halves agree."""

from __future__ import annotations

import ast
import inspect
import pickle

import pytest

from fanrun import _core
from fanrun._rank import contract as _run_contract
from fanrun.backends.local import KEEPER


def test_the_control_channel_is_the_same_in_both_languages():
    """What a rank writes on its control channel is what the engine reads there."""
    assert _run_contract.CONTROL_FD == _core.CONTROL_FD
    assert _run_contract.CONTROL_FAILED == _core.CONTROL_FAILED
    assert _run_contract.CONTROL_DONE == _core.CONTROL_DONE
    assert _run_contract.CONTROL_LOG == _core.CONTROL_LOG
    assert _run_contract.SPARE_CALL == _core.SPARE_CALL
    assert _run_contract.SPARE_READY == _core.SPARE_READY
    assert _run_contract.ZYGOTE_FORK == _core.ZYGOTE_FORK
    assert _run_contract.CONTROL_KEPT == _core.CONTROL_KEPT


def test_the_python_contract_imports_nothing_but_signal():
    """A rank's worker runs the contract by path before anything else is imported: it imports
    only the built-in signal module (the stack-dump signal's type), so that it costs a rank
    nothing and cannot pull fanrun's package in."""
    tree = ast.parse(inspect.getsource(_run_contract))
    imports = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports == ["import signal"]


def test_the_output_streams_are_the_same_in_both_languages():
    """The engine names the stream of each piece of output as the contract numbers it."""
    assert [(stream.name, stream.value) for stream in _core.Stream] == [
        ("STDOUT", _run_contract.STDOUT), ("STDERR", _run_contract.STDERR)]


def test_events_and_stop_reasons_cross_the_border_as_enums():
    """The engine hands up event kinds, streams, segment kinds and stop reasons as enums, never as
    bare numbers or strings."""
    assert [kind.name for kind in _core.EventKind] == ["OUTPUT", "RANK_FAILED", "RANK_EXITED", "TIMED_OUT"]
    assert [kind.name for kind in _core.SegmentKind] == ["LINE", "PARTIAL", "PROGRESS"]
    assert [reason.name for reason in _core.StopReason] == ["NONE", "RANK_FAILED", "TIMEOUT", "CANCELLED"]
    assert _core.StopReason.TIMEOUT != "timeout"
    assert _core.EventKind.OUTPUT != 0


def test_a_rank_speaking_the_python_contract_is_understood_by_the_engine(runs_dir, tmp_path):
    """A rank that writes the Python contract's messages on its control channel is heard by the
    engine: text sent with CONTROL_LOG goes to its log alone, CONTROL_FAILED stops the run with
    the rank as the root cause."""
    channel = _run_contract.CONTROL_FD
    script = (
        f"printf '{_run_contract.CONTROL_LOG}6\\nlogged' >&{channel}; echo shown; "
        f"printf '{_run_contract.CONTROL_FAILED}\\n' >&{channel}; exec sleep 60"
    )
    log = tmp_path / "rank_0.log"
    rank = _core.RankOptions(argv=["/bin/sh", "-c", script],
                             env=["PATH=/usr/bin:/bin", f"{_run_contract.ENV_RUN_DIR}={runs_dir}/contract"],
                             cwd=str(tmp_path), log_path=str(log))
    supervisor = _core.Supervisor.start(_core.SupervisorOptions(ranks=[rank], keeper_path=KEEPER, stack_dump_wait_s=0.0))
    events = []
    done = False
    while not done:
        batch, _interrupted, done = supervisor.wait(10.0)
        events.extend(batch)
    assert _core.EventKind.RANK_FAILED in [event.kind for event in events]
    assert supervisor.stop_reason == _core.StopReason.RANK_FAILED
    assert supervisor.first_failed_rank == 0
    output = [event for event in events if event.kind == _core.EventKind.OUTPUT]
    assert b"".join(event.data for event in output) == b"shown"
    assert [type(event.stream) for event in output] == [_core.Stream] and output[0].stream == _core.Stream.STDOUT
    logged = log.read_bytes()  # the two in either order: the log text follows what the pipes held when it came
    assert sorted([logged.replace(b"shown\n", b""), logged.replace(b"logged", b"")]) == [b"logged", b"shown\n"]


def test_an_event_is_read_only_and_crosses_processes_pickled():
    """An event's fields are named and cannot be changed; a cluster's node agents send theirs
    to the caller pickled, and each comes back whole, renumbered among the run's ranks."""
    event = _core.Event(kind=_core.EventKind.OUTPUT, rank=1, stream=_core.Stream.STDERR,
                        segment=_core.SegmentKind.PARTIAL, data=b"half a line\x00\xff")
    with pytest.raises(AttributeError):
        event.rank = 2
    exited = _core.Event(kind=_core.EventKind.RANK_EXITED, rank=0, exit_code=3, signal=0)
    fields = ("kind", "rank", "stream", "segment", "data", "exit_code", "signal")
    for sent in (event, exited):
        received = pickle.loads(pickle.dumps(sent))
        assert type(received) is _core.Event
        assert [getattr(received, name) for name in fields] == [getattr(sent, name) for name in fields]
    renumbered = event.with_rank(5)
    assert (renumbered.rank, event.rank, renumbered.data) == (5, 1, event.data)
    assert "rank=5" in repr(renumbered) and "Stream.STDERR" in repr(renumbered)
