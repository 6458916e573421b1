"""The run contract is defined once per language (src/fanrun/_rank/contract.py and
cpp/include/fanrun/run_contract.h), and the two halves agree."""

from __future__ import annotations

import ast
import inspect

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
    assert _run_contract.CONTROL_KEPT == _core.CONTROL_KEPT


def test_the_python_contract_imports_nothing():
    """A rank's worker runs the contract by path before anything else is imported: it stays free
    of imports, so that it costs a rank nothing and cannot pull fanrun's package in."""
    tree = ast.parse(inspect.getsource(_run_contract))
    imports = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports == []


def test_events_and_stop_reasons_cross_the_border_as_enums():
    """The engine hands up event kinds, segment kinds and stop reasons as enums, never as bare
    numbers or strings."""
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
    supervisor = _core.Supervisor.start(
        argvs=[["/bin/sh", "-c", script]],
        envs=[["PATH=/usr/bin:/bin", f"{_run_contract.ENV_RUN_DIR}={runs_dir}/contract"]],
        cwd=str(tmp_path),
        log_paths=[str(log)],
        timeout_s=0.0,
        kill_grace_s=5.0,
        stack_dump_signal=0,
        stack_dump_wait_s=0.0,
        wakeup_fd=-1,
        control_channel=True,
        expect_done=False,
        keeper=KEEPER,
    )
    events = []
    done = False
    while not done:
        batch, _interrupted, done = supervisor.wait(10.0)
        events.extend(batch)
    kinds = [kind for kind, *_ in events]
    assert _core.EventKind.RANK_FAILED in kinds
    assert supervisor.stop_reason == _core.StopReason.RANK_FAILED
    assert supervisor.first_failed_rank == 0
    shown = b"".join(text for kind, _rank, _stream, _segment, text, _exit in events if kind == _core.EventKind.OUTPUT)
    assert shown == b"shown"
    logged = log.read_bytes()  # the two in either order: the log text follows what the pipes held when it came
    assert sorted([logged.replace(b"shown\n", b""), logged.replace(b"logged", b"")]) == [b"logged", b"shown\n"]
