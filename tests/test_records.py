"""Every run's record (_launch/records.py): a blocking call from any door, as a detached run, has
one id, which it says as it starts, and which `fanrun list`, `stacks`, `logs`, `attach`, `cancel`
and fanrun.Run take; a killed caller's record reads FAILED; records are pruned to the newest, never
one whose runner holds it; a damaged or planted record is refused. Real callers, ranks and CLI."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from private_files import write_private

import fanrun
from fanrun import distributed
from fanrun._launch import records
from processes import wait_gone

RUN_ID = re.compile(r"[\w.-]+-\d{8}-\d{6}-[0-9a-f]{6}")
STARTED = re.compile(r"fanrun: run (\S+) started: [^;]+; fanrun stacks \1 shows every rank's stack")

# A blocking call of two ranks, which say where they are and wait at a gate (a file) before they end.
CALLER = """
import sys
from fanrun import distributed

@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display=sys.argv[2])
def steps(gate):
    import os, time
    from pathlib import Path

    rank = os.environ["RANK"]
    print(f"before the gate, rank {rank}", flush=True)
    Path(gate).with_name(f"rank{rank}").write_text(str(os.getpid()))
    while not Path(gate).exists():
        time.sleep(0.02)
    print(f"after the gate, rank {rank}", flush=True)
    return int(rank)

print("returned", steps.distributed(sys.argv[1]), flush=True)
"""


@pytest.fixture
def runs_root(runs_dir, monkeypatch, request):
    """A fresh FANRUN_RUNS_DIR of this test's own, under the session's (so that the
    no_process_left_behind fixture sees its ranks), for it and every process it starts."""
    root = Path(tempfile.mkdtemp(prefix=f"records-{request.node.name[:40]}-", dir=runs_dir))  # 0700
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(root))
    return root


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fanrun", *args], capture_output=True, text=True, timeout=timeout)


def listed(*args: str) -> dict[str, list[str]]:
    """`fanrun list`'s rows by run id: [STATUS, WHY], cut where the header's columns start."""
    shown = cli("list", *args)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    if not lines:
        return {}
    status, started, why = (lines[0].index(column) for column in ("STATUS", "STARTED", "WHY"))
    return {line.split()[0]: [line[status:started].strip(), line[why:].strip()] for line in lines[1:]}


def start_caller(folder: Path, display: str = "logs") -> tuple[subprocess.Popen, Path]:
    script = folder / "caller.py"
    script.write_text(CALLER)
    gate = folder / "gate"
    caller = subprocess.Popen([sys.executable, str(script), str(gate), display], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    return caller, gate


class Lines:
    """The lines a process writes to a pipe, read as they come: from the descriptor itself, with no
    buffer of Python's between (which select() would not see)."""

    def __init__(self, stream) -> None:
        self.fd = stream.fileno()
        self.pending = b""

    def until(self, pattern: re.Pattern | str, timeout: float = 120) -> str:
        """The first line that matches `pattern` (or holds it, as text); the lines before it are dropped."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" not in self.pending:
                ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
                assert ready, f"no line with {pattern} within {timeout} s"
                data = os.read(self.fd, 65536)
                assert data, f"the stream ended before a line with {pattern}: {self.pending!r}"
                self.pending += data
            line, _, self.pending = self.pending.partition(b"\n")
            text = line.decode(errors="replace")
            if (pattern.search(text) if isinstance(pattern, re.Pattern) else pattern in text):
                return text

    def each(self, needles: list[str], timeout: float = 120) -> set[str]:
        """Lines until each of `needles` has been in one: every line read."""
        seen: set[str] = set()
        for needle in needles:
            while not any(needle in line for line in seen):
                seen.add(self.until("", timeout))
        return seen


def started_id(caller: subprocess.Popen) -> str:
    return STARTED.search(Lines(caller.stderr).until(STARTED)).group(1)


def rank_pids(folder: Path, count: int = 2, timeout: float = 120) -> list[int]:
    """The ranks' pids, once every rank of the caller waits at its gate."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [folder / f"rank{rank}" for rank in range(count)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("the ranks did not reach the gate")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=60)


def test_a_blocking_call_is_listed_stacked_logged_and_attached_while_it_runs_and_listed_after(runs_root, tmp_path):
    caller, gate = start_caller(tmp_path)
    attach = None
    try:
        run_id = started_id(caller)
        assert RUN_ID.fullmatch(run_id) and run_id.startswith("steps-"), run_id
        rank_pids(tmp_path)
        assert listed()[run_id][0] == "RUNNING"
        stacks = cli("stacks", run_id)
        assert stacks.returncode == 0, stacks.stderr
        for rank in range(2):
            section = stacks.stdout.split(f"--- rank {rank} of run {run_id} ---")[1].split("--- rank")[0]
            assert "(most recent call first)" in section and "steps" in section, stacks.stdout
        logs = cli("logs", run_id)
        assert logs.returncode == 0 and "[rank0]: before the gate, rank 0\n" in logs.stdout, logs
        assert "[rank1]: before the gate, rank 1\n" in logs.stdout and "after the gate" not in logs.stdout
        # Its results are its caller's, and it is stopped where it runs: each says so.
        cancelled = cli("cancel", run_id)
        assert cancelled.returncode == 1 and "is a blocking call" in cancelled.stderr, cancelled.stderr
        assert "Ctrl+C" in cancelled.stderr and f"kill -INT {caller.pid}" in cancelled.stderr, cancelled.stderr
        with pytest.raises(fanrun.FanrunError, match=f"run {run_id} is a blocking call, whose results went to its caller"):
            fanrun.Run(run_id).result()
        # attach follows it live: what the ranks wrote comes while they still wait at the gate.
        attach = subprocess.Popen([sys.executable, "-m", "fanrun", "attach", run_id], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        attached = Lines(attach.stdout)
        seen = attached.each(["before the gate, rank 0", "before the gate, rank 1"])
        assert caller.poll() is None and listed()[run_id][0] == "RUNNING"
        gate.touch()
        rest, attach_err = attach.communicate(timeout=120)
        assert attach.returncode == 0, attach_err
        assert f"fanrun: run {run_id} FINISHED" in attach_err
        shown = seen | set((attached.pending.decode() + rest).splitlines())
        assert {f"[rank{rank}]: {when} the gate, rank {rank}" for rank in range(2) for when in ("before", "after")} <= shown
        out, err = caller.communicate(timeout=120)
        assert caller.returncode == 0 and out.endswith("\nreturned [0, 1]\n"), err
    finally:
        gate.touch()
        stop(caller)
        if attach is not None:
            stop(attach)
    assert run_id not in listed() and listed("--all")[run_id][0] == "FINISHED"
    run = fanrun.Run(run_id)
    assert run.status == "FINISHED" and run.wait(timeout=1) == "FINISHED"
    assert run.info["kind"] == "blocking" and run.info["world_size"] == 2 and len(run.info["run_dirs"]) == 1
    # One rank's log as it is, unlabelled: its lines alone. `fanrun stacks` asked the rank on its
    # FIFO, so no dump went into the log.
    for rank, logs in enumerate([cli("logs", run_id, "--rank", "0").stdout, run.logs(rank=1)]):
        assert logs == f"before the gate, rank {rank}\nafter the gate, rank {rank}\n", logs
    assert cli("cancel", run_id).returncode == 0  # ended already: nothing to stop
    again = cli("attach", run_id)  # an ended run: its whole output, at once
    assert again.returncode == 0 and "[rank1]: after the gate, rank 1\n" in again.stdout, again.stderr


@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
def says_its_run_id():
    import os

    return os.environ["FANRUN_RUN_ID"]


@distributed(num_accelerators=1, accelerator_type="CPU", tracking=False, detach=True)
def detached_says_its_run_id():
    import os

    return os.environ["FANRUN_RUN_ID"]


def tells_its_run_id():
    import os

    return os.environ["FANRUN_RUN_ID"]


def test_every_door_gives_its_run_one_id_of_one_scheme(runs_root, capfd):
    """The decorator, `fanrun run`, TorchDistributor and a detached run: one scheme, the id said
    as the run starts, the one its ranks get, the one every command takes."""
    ids = {}
    # The decorator.
    ranks_say = says_its_run_id.distributed()
    ids["decorator"] = STARTED.search(capfd.readouterr().err).group(1)
    assert ranks_say == [ids["decorator"]] * 2
    # TorchDistributor.
    from fanrun import TorchDistributor

    told = TorchDistributor(num_processes=2, use_gpu=False).run(tells_its_run_id)
    ids["TorchDistributor"] = STARTED.search(capfd.readouterr().err).group(1)
    assert told == ids["TorchDistributor"]
    # `fanrun run`.
    ran = cli("run", "-n", "2", "--accelerator-type", "CPU", "--no-python", "/bin/sh", "-c", 'echo "id $FANRUN_RUN_ID"')
    assert ran.returncode == 0, ran.stderr
    ids["fanrun run"] = STARTED.search(ran.stderr).group(1)
    assert f"[rank1]: id {ids['fanrun run']}" in ran.stdout
    # A detached run, which says it in its output.
    run = detached_says_its_run_id.distributed()
    assert run.result(timeout=120) == [run.id]
    assert STARTED.search(run.logs()).group(1) == run.id
    ids["detached"] = run.id

    every = listed("--all")
    for door, run_id in ids.items():
        assert RUN_ID.fullmatch(run_id), (door, run_id)
        assert every[run_id][0] == "FINISHED", (door, every)
        assert fanrun.Run(run_id).info["kind"] == ("detached" if door == "detached" else "blocking"), door
    assert [run.id for run in fanrun.runs(all=True)] == list(ids.values())  # oldest first
    assert cli("logs", ids["fanrun run"]).stdout == "".join(f"[rank{rank}]: id {ids['fanrun run']}\n" for rank in range(2))


@pytest.mark.parametrize("display", ["logs", "quiet"])
def test_the_id_is_said_once_as_the_run_starts(runs_root, tmp_path, display):
    """In every display but the panel, whose title it is (tests/test_panel.py): one line on stderr."""
    caller, gate = start_caller(tmp_path, display)
    gate.touch()
    out, err = caller.communicate(timeout=120)
    assert caller.returncode == 0 and out.endswith("returned [0, 1]\n"), err
    said = [line for line in err.splitlines() if line.startswith("fanrun: run ")]
    assert len(said) == 1 and STARTED.fullmatch(said[0]), err
    run_id = STARTED.fullmatch(said[0]).group(1)
    assert said[0] == f"fanrun: run {run_id} started: 2 CPU processes; fanrun stacks {run_id} shows every rank's stack"
    assert fanrun.Run(run_id).status == "FINISHED"
    if display == "quiet":
        assert "[rank" not in out + err
    else:
        assert "[rank0]: after the gate, rank 0" in out + err


def test_a_caller_killed_with_sigkill_leaves_a_record_that_reads_failed(runs_root, tmp_path):
    caller, _ = start_caller(tmp_path)  # its gate never opens
    try:
        run_id = started_id(caller)
        ranks = rank_pids(tmp_path)
        attach = subprocess.Popen([sys.executable, "-m", "fanrun", "attach", run_id], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        Lines(attach.stdout).until("before the gate")
        caller.send_signal(signal.SIGKILL)
        caller.communicate(timeout=60)
        # attach learns of the caller's end at once, from its pidfd: it never waits on a clock.
        _, attach_err = attach.communicate(timeout=60)
    finally:
        stop(caller)
    assert wait_gone(ranks, timeout=30) == []  # no rank outlives its caller
    reason = f"its caller (pid {caller.pid}) ended without recording an outcome"
    assert attach.returncode == 1 and f"run {run_id} FAILED: {reason}" in attach_err, attach_err
    assert run_id not in listed()
    assert listed("--all")[run_id] == ["FAILED", reason]
    run = fanrun.Run(run_id)
    assert run.status == "FAILED" and run.info["ended"] >= run.info["created"]
    assert records.RunRecord.find(run_id).read_state()["status"] == "FAILED"  # marked on disk by its first reader


FAILS_FIRST = """
import os, sys
if os.environ["FANRUN_RESTART_COUNT"] == "0":
    print("the first attempt fails", flush=True)
    sys.exit(3)
print("the second attempt runs", flush=True)
"""


def test_a_blocking_calls_record_ends_as_the_call_did(runs_root, tmp_path):
    """FAILED with its reason's first line; KILLED by Ctrl+C; each attempt's run directory kept,
    and its output told apart in `fanrun logs`."""
    script = tmp_path / "fails_first.py"
    script.write_text(FAILS_FIRST)
    restarted = cli("run", "-n", "1", "--accelerator-type", "CPU", "--max-restarts", "1", str(script))
    assert restarted.returncode == 0, restarted.stderr
    run = fanrun.Run(STARTED.search(restarted.stderr).group(1))
    assert run.status == "FINISHED" and len(run.info["run_dirs"]) == 2 and run.info["run_dir"] == run.info["run_dirs"][1]
    logs = run.logs()
    second = re.escape(run.info["run_dirs"][1])
    assert re.fullmatch(rf"\[rank0\]: the first attempt fails\n.*\[rank0\]: SystemExit: 3\n"
                        rf"fanrun: attempt 2, in {second}\n\[rank0\]: the second attempt runs\n", logs, re.S), logs

    failed = cli("run", "-n", "1", "--accelerator-type", "CPU", "--no-python", "/bin/sh", "-c", "exit 7")
    assert failed.returncode == 7
    info = fanrun.Run(STARTED.search(failed.stderr).group(1)).info
    assert info["status"] == "FAILED" and info["reason"].startswith("RankFailedError: Rank 0 of 1") and "\n" not in info["reason"]

    # Ctrl+C, and a scheduler's SIGTERM, which `fanrun run` takes as Ctrl+C.
    for signo, exit_code, reason in [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped (SystemExit 143)")]:
        stopped = subprocess.Popen([sys.executable, "-m", "fanrun", "run", "-n", "1", "--accelerator-type", "CPU",
                                    "--no-python", "/bin/sh", "-c", "echo waiting; exec sleep 300"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            run_id = started_id(stopped)
            Lines(stopped.stdout).until("waiting")
            stopped.send_signal(signo)
            stopped.communicate(timeout=60)
        finally:
            stop(stopped)
        assert stopped.returncode == exit_code
        info = fanrun.Run(run_id).info
        assert (info["status"], info["reason"]) == ("KILLED", reason), info


@distributed(num_accelerators=1, accelerator_type="CPU", tracking=False)
def quick():
    return 1


def test_records_beyond_the_newest_are_pruned_never_one_whose_runner_holds_it(runs_root, tmp_path, monkeypatch):
    monkeypatch.setattr(records, "KEEP_RECORDS", 3)
    for folder in ("live", "dead"):
        (tmp_path / folder).mkdir()
    live, live_gate = start_caller(tmp_path / "live")
    dead, _ = start_caller(tmp_path / "dead")
    try:
        live_id, dead_id = started_id(live), started_id(dead)
        rank_pids(tmp_path / "live")
        dead_ranks = rank_pids(tmp_path / "dead")
        dead.send_signal(signal.SIGKILL)
        dead.communicate(timeout=60)
        assert wait_gone(dead_ranks, timeout=30) == []
        # A record this process runs: ended, but not let go yet (as a detached runner's, whose readers take the end).
        held = records.RunRecord.create("held", kind=records.BLOCKING, world_size=1, owner=True)
        held.end(records.FINISHED)
        calls = []
        for _ in range(6):
            quick.distributed()
            records.pruned()  # each call's pruning, which it does not wait for
            calls.append(records.all_records()[-1].id)
        left = [record.id for record in records.all_records()]
        assert left == [live_id, held.id, *calls[-3:]], (left, calls, dead_id)
        held.release()
        quick.distributed()
        records.pruned()
        assert held.id not in [record.id for record in records.all_records()]
        live_gate.touch()
        out, err = live.communicate(timeout=120)
        assert live.returncode == 0, err
        quick.distributed()
        records.pruned()
        assert live_id not in [record.id for record in records.all_records()]
    finally:
        live_gate.touch()
        stop(live)
        stop(dead)


def test_a_notebook_calling_many_times_keeps_the_newest_hundred_records(runs_root):
    made = []
    for _ in range(records.KEEP_RECORDS + 10):
        record = records.RunRecord.create("cell", kind=records.BLOCKING, world_size=1, owner=True)
        record.end(records.FINISHED)
        record.release()
        made.append(record.id)
        records.pruned()
    quick.distributed()
    records.pruned()
    newest = records.all_records()[-1].id
    assert len(os.listdir(runs_root / "records")) == records.KEEP_RECORDS == 100
    assert [record.id for record in records.all_records()] == made[11:] + [newest]


def test_a_record_naming_a_directory_outside_the_runs_root_is_never_read(runs_root, tmp_path):
    """A record's run directory is read only in the runs root, never through a link: a planted one,
    elsewhere, with logs and a ranks.json naming a process, is neither shown nor signalled."""
    planted = tmp_path / "20261201-000000-000000-planted-abcdef"
    planted.mkdir(mode=0o700)
    write_private(planted / "rank_0.log", b"PLANTED\n")
    write_private(planted / "ranks.json", json.dumps({"host": os.uname().nodename, "ranks": [[os.getpid(), None]]}).encode())
    link = runs_root / planted.name
    link.symlink_to(planted)
    for named in (planted, link):
        record = records.RunRecord.create("planted", kind=records.BLOCKING, world_size=1, owner=True)
        try:
            record.attempt(named)
            stacks = cli("stacks", record.id)
            assert stacks.returncode == 2 and "names no run directory of fanrun's runs directory" in stacks.stderr, stacks
            for args in ([], ["--rank", "0"]):
                logs = cli("logs", record.id, *args)
                assert logs.returncode == 0 and "PLANTED" not in logs.stdout + logs.stderr, logs
            assert "PLANTED" not in (fanrun.Run(record.id).logs() or "")
        finally:
            record.end(records.FINISHED)
            record.release()


def test_damaged_and_foreign_records_are_listed_as_damaged_and_never_pruned(runs_root, monkeypatch):
    monkeypatch.setattr(records, "KEEP_RECORDS", 2)
    parent = runs_root / "records"
    parent.mkdir(mode=0o700)
    damaged = {"garbage-20261201-000000-00000a": "its state.json is not JSON"}
    (parent / "garbage-20261201-000000-00000a").mkdir(mode=0o700)
    write_private(parent / "garbage-20261201-000000-00000a" / records.STATE, b"\x00{")
    ended = {"status": "FINISHED", "kind": "blocking", "created": 0}
    if os.geteuid() == 0:  # a state.json that another user made: never trusted
        foreign = parent / "foreign-20261201-000000-00000b"
        foreign.mkdir(mode=0o700)
        write_private(foreign / records.STATE, json.dumps(ended).encode())
        os.chown(foreign / records.STATE, 65534, 65534)
        damaged[foreign.name] = "belongs to uid 65534, not to you"
    linked = parent / "linked-20261201-000000-00000c"
    linked.mkdir(mode=0o700)
    (linked / records.STATE).symlink_to(runs_root / "elsewhere.json")
    (runs_root / "elsewhere.json").write_text(json.dumps(ended))
    damaged[linked.name] = "symbolic link"
    for _ in range(4):
        quick.distributed()
        records.pruned()
    rows = listed("--all")
    for name, why in damaged.items():
        assert (parent / name).is_dir() and rows[name][0] == "DAMAGED" and why in rows[name][1], (name, rows)
    assert len([name for name in rows if name not in damaged]) == 2  # the newest two calls
    with pytest.raises(records.DamagedRunError, match="its state.json is not JSON"):
        fanrun.Run("garbage-20261201-000000-00000a")


def test_a_run_id_that_is_not_one_is_named():
    for command in (["logs", "../etc"], ["stacks", "../etc"], ["attach", "train"]):
        shown = cli(*command)
        assert shown.returncode == 2 and "is not a run id (a run id looks like" in shown.stderr, shown
    with pytest.raises(fanrun.UnknownRunError, match="no run train-20261201-000000-000000 in "):
        fanrun.Run("train-20261201-000000-000000")


def test_the_record_costs_a_call_no_more_than_a_millisecond_or_so(runs_root):
    """What call.run() adds for the record: made, its attempt, its end; at the limit, where each
    new record prunes one (in a thread, which the call does not wait for). The best of several
    batches, on a machine that others share."""
    def calls(count: int) -> float:
        took = 0.0
        for _ in range(count):
            started = time.perf_counter()
            with records.of_call("cost", 2) as record:
                record.attempt(runs_root / "nowhere")
            took += time.perf_counter() - started
            records.pruned()  # done while a call's ranks run, which these calls have none of
        return took / count

    calls(records.KEEP_RECORDS + 5)
    assert min(calls(10) for _ in range(10)) < 0.002
