"""The fault matrix of detached runs (_detached/): slow and stalled readers of a run's socket, a full
disk under a run, damaged run directories, and control sequences in what a rank prints. Each
test runs real runners and real ranks, reads over the real socket, and asks the real CLI."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from private_files import write_private

import fanrun
from fanrun import distributed
from fanrun._detached import files
from fanrun._launch import records
from fanrun._display.terminal_text import printable
from fanrun._spec.paths import RunPaths
from processes import wait_gone

# What a hostile exception text may hold: set the window's title (OSC 0), ask the terminal for
# its cursor's place (CSI 6n, whose answer lands in the terminal's input), the same through C1's
# one-character CSI (U+009B, b"\xc2\x9b" in UTF-8), reset the terminal, and ring its bell.
HOSTILE = "\x1b]0;owned\x07|\x1b[6n|\x9b6n|\x1bc|\x07|\x00"
# Any control character but a newline, a tab and a carriage return.
CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@distributed(num_accelerators=1, detach=True)
def prints_then_waits(megabytes, gate):
    import time
    from pathlib import Path

    for _ in range(megabytes * 10_000):
        print("x" * 99)
    while not Path(gate).exists():
        time.sleep(0.02)
    print("after the gate")
    return "done"


@distributed(num_accelerators=1, detach=True)
def waits_then_prints(gate, megabytes):
    import time
    from pathlib import Path

    while not Path(gate).exists():
        time.sleep(0.02)
    for _ in range(megabytes * 10_000):
        print("y" * 99)
    return "done"


@distributed(num_accelerators=1, detach=True)
def hostile_rank():
    print(f"before{HOSTILE}\tafter")
    raise ValueError(f"boom{HOSTILE}")


@distributed(num_accelerators=1, detach=True)
def quick():
    return 1


@distributed(num_accelerators=1, detach=True)
def a_run_with_a_much_longer_name():
    return 2


@pytest.fixture
def runs_root(runs_dir, monkeypatch, request):
    """A fresh FANRUN_RUNS_DIR of this test's own, under the session's (so that the
    no_process_left_behind fixture sees its runners and ranks)."""
    root = Path(tempfile.mkdtemp(prefix=f"detached-{request.node.name[:40]}-", dir=runs_dir))  # 0700
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(root))
    return root


@pytest.fixture
def tiny_runs_root(runs_dir, monkeypatch, request):
    """FANRUN_RUNS_DIR on a tmpfs of 1 MiB of its own, unmounted at the end."""
    mount_point = runs_dir / f"tiny-{request.node.name[:40]}"
    mount_point.mkdir(mode=0o700)
    mounted = None
    if shutil.which("mount"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount_point)],
                                 capture_output=True, text=True)
    if mounted is None or mounted.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"a tmpfs cannot be mounted here: {mounted.stderr.strip() if mounted else 'no mount command'}")
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(mount_point))
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
        mount_point.rmdir()


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fanrun", *args], capture_output=True, text=True, timeout=timeout)


def runner_pid(run: fanrun.Run) -> int:
    return records.RunRecord.find(run.id).read_runner()["pid"]


def connect(run: fanrun.Run) -> socket.socket:
    """A reader of the run's socket, as stream.follow() connects, from offset 0."""
    dir_fd = os.open(records.RunRecord.find(run.id).directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        reader.connect(f"/proc/self/fd/{dir_fd}/{files.SOCKET}")  # a run's path may be too long for an address
    finally:
        os.close(dir_fd)
    return reader


class Client(threading.Thread):
    """A reader of the run's socket that does `step` every `every_s` seconds until closed."""

    def __init__(self, run: fanrun.Run, first: bytes, step, every_s: float) -> None:
        super().__init__(daemon=True)
        self.reader = connect(run)
        self.reader.sendall(first)
        self._step, self._every_s, self._closing = step, every_s, threading.Event()
        self.start()

    def run(self) -> None:
        while not self._closing.wait(self._every_s):
            try:
                if self._step(self.reader) is False:
                    return
            except OSError:
                return  # dropped by the runner

    def close(self) -> None:
        self._closing.set()
        self.join()
        self.reader.close()


def wait_for_log(run: fanrun.Run, size: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    log = records.RunRecord.find(run.id).directory / files.OUTPUT
    while log.stat().st_size < size:
        assert time.monotonic() < deadline, f"the run wrote {log.stat().st_size} of {size} bytes in {timeout} s"
        time.sleep(0.05)


def test_a_slow_reader_never_slows_a_run_and_a_dropped_one_resumes_from_its_offset(runs_root, tmp_path):
    gate = tmp_path / "gate"
    run = prints_then_waits.distributed(2, str(gate))
    wait_for_log(run, 2_000_000)
    # It takes 64 KB every 3 s: the 2 MB written before it came would take it 90 s.
    slow = Client(run, b"0\n", lambda reader: bool(reader.recv(64 * 1024)), every_s=3.0)
    try:
        gate.touch()
        assert run.wait(timeout=40) == "FINISHED"
        assert run.result() == ["done"]
    finally:
        slow.close()
        run.wait(timeout=120)
    # A reader that is far behind reads on from the log on disk, and gets every byte.
    again = subprocess.run([sys.executable, "-m", "fanrun", "attach", run.id], capture_output=True, timeout=120)
    assert again.stdout == (records.RunRecord.find(run.id).directory / files.OUTPUT).read_bytes()
    assert wait_gone([runner_pid(run)], timeout=30) == []


def test_a_follower_dropped_for_reading_slowly_resumes_from_its_offset_and_gets_every_byte(runs_root, tmp_path):
    gate = tmp_path / "gate"
    run = waits_then_prints.distributed(str(gate), 3)
    received = bytearray()
    with subprocess.Popen([sys.executable, "-m", "fanrun", "logs", run.id, "-f"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as follower:
        # The run prints 3.3 MB while nobody reads the follower's pipe: more than the pipe, the
        # socket and the follower's queue in the runner (1 MiB) hold, so the runner drops it, and
        # it connects again from its offset, or reads on from the log once the run has ended.
        gate.touch()
        wait_for_log(run, 30_000 * len(f"[rank0]: {'y' * 99}\n"))
        while chunk := follower.stdout.read1(256 * 1024):
            received += chunk
            time.sleep(0.01)
        err = follower.communicate(timeout=60)[1]
    assert follower.returncode == 0, err
    assert run.wait(timeout=60) == "FINISHED"
    assert bytes(received) == (records.RunRecord.find(run.id).directory / files.OUTPUT).read_bytes()
    assert wait_gone([runner_pid(run)], timeout=30) == []


def test_a_reader_that_trickles_its_first_line_holds_up_no_other_reader_nor_the_runners_end(runs_root, tmp_path):
    gate = tmp_path / "gate"
    run = prints_then_waits.distributed(0, str(gate))
    # One digit a second, never a newline: within any per-byte timeout, forever.
    trickler = Client(run, b"0", lambda reader: reader.sendall(b"0"), every_s=1.0)
    attach = subprocess.Popen([sys.executable, "-m", "fanrun", "attach", run.id], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        gate.touch()
        out, err = attach.communicate(timeout=60)
        assert attach.returncode == 0, err
        assert "after the gate" in out
        # The runner ends with its run, while the trickler still trickles.
        assert wait_gone([runner_pid(run)], timeout=30) == []
    finally:
        if attach.poll() is None:
            attach.kill()
            attach.wait()
        trickler.close()
        run.wait(timeout=120)


def test_a_full_disk_fails_the_run_with_its_reason_and_every_run_still_lists(tiny_runs_root, tmp_path):
    # A run whose runner is killed: its state stays RUNNING until a reader marks it, on a full disk.
    killed = prints_then_waits.distributed(0, str(tmp_path / "never"))
    killed_runner = runner_pid(killed)
    os.kill(killed_runner, signal.SIGKILL)
    assert wait_gone([killed_runner], timeout=30) == []
    # 5 MB of output on a disk of 1 MiB.
    gate = tmp_path / "gate"
    gate.touch()
    run = prints_then_waits.distributed(5, str(gate))
    assert run.wait(timeout=240) == "FAILED"
    assert run.info["reason"].startswith("disk full"), run.info
    with pytest.raises(fanrun.FanrunError, match="disk full"):
        run.result()
    assert wait_gone([runner_pid(run)], timeout=30) == []
    fill(tiny_runs_root / "filler")  # the room the runner gave back too: a reader cannot write a byte
    listed = cli("list", "--all")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert rows[run.id].split()[1] == "FAILED" and "disk full" in rows[run.id], listed.stdout
    assert rows[killed.id].split()[1] == "FAILED" and "ended without recording an outcome" in rows[killed.id]
    assert records.RunRecord.find(killed.id).read_state()["status"] not in records.FINAL  # shown, not written
    logs = cli("logs", run.id)
    assert logs.returncode == 0 and f"[rank0]: {'x' * 99}\n" in logs.stdout, logs.stderr


def fill(path: Path) -> None:
    """Writes `path` until its disk is full."""
    with open(path, "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error


def test_a_damaged_run_is_listed_as_damaged_and_every_other_run_still_lists(runs_root, tmp_path):
    good = quick.distributed()
    assert good.wait(timeout=60) == "FINISHED"
    detached = runs_root / "records"
    elsewhere = tmp_path / "state.json"
    elsewhere.write_text(json.dumps({"status": "FINISHED", "reason": "FOLLOWED A LINK", "created": 0}))
    damaged = {}

    def run_directory(why: str, state: bytes | None) -> Path:
        directory = detached / f"damaged{len(damaged)}-20261201-000000-abcdef"
        directory.mkdir(mode=0o700)
        if state is not None:
            write_private(directory / records.STATE, state)
        damaged[directory.name] = why
        return directory

    run_directory("is not JSON", b"\x00garbage{")
    run_directory("a JSON list, not an object", b"[1, 2, 3]")
    run_directory("its status is none of", json.dumps({"status": "HAPPY"}).encode())
    run_directory("its created is not a time", json.dumps({"status": "FINISHED", "created": "yesterday"}).encode())
    (run_directory("symbolic link", None) / records.STATE).symlink_to(elsewhere)
    runner_damaged = run_directory("runner.json", json.dumps({"status": "RUNNING", "created": time.time()}).encode())
    write_private(runner_damaged / records.RUNNER, b'{"pid": "me"}')
    a_file = detached / "afile-20261201-000000-abcdef"
    write_private(a_file, b"")
    damaged[a_file.name] = "is a file, not a run's directory"
    (detached / "alink-20261201-000000-abcdef").symlink_to(detached / good.id)
    damaged["alink-20261201-000000-abcdef"] = "is a symbolic link"

    for every in (True, False):
        listed = cli("list", *(["--all"] if every else []))
        assert listed.returncode == 0 and listed.stderr == "", listed.stderr
        rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
        assert (good.id in rows) == every, listed.stdout
        for name, why in damaged.items():
            assert rows[name].split()[1] == "DAMAGED" and why in rows[name], (name, listed.stdout)
        assert "FOLLOWED" not in listed.stdout
    listed_runs = fanrun.runs(all=True)
    assert [run.id for run in listed_runs][-1] == good.id  # damaged entries are runs too, oldest first
    assert all(" DAMAGED>" in repr(run) for run in listed_runs[:-1])
    with pytest.raises(fanrun.FanrunError, match="its state.json is not JSON"):
        fanrun.Run("damaged0-20261201-000000-abcdef")
    for name, why in damaged.items():
        logs = cli("logs", name)
        assert logs.returncode == 1 and "Traceback" not in logs.stderr, logs.stderr
        assert logs.stderr.startswith("fanrun: ") and why in logs.stderr and len(logs.stderr.splitlines()) == 1


@pytest.mark.parametrize("record", [
    b"{not json", b"[1, 2]", b'{"ranks": [[1, 2]]}', b'{"host": "%s", "ranks": "all"}',
    b'{"host": "%s", "ranks": [["one", 2]]}', b'{"host": "%s", "ranks": [[1]]}', b"link",
], ids=["garbage", "list", "no-host", "ranks-text", "pid-text", "short-pair", "symlink"])
def test_fanrun_stacks_on_a_damaged_ranks_json_says_what_is_wrong(runs_root, tmp_path, record):
    # A running run's record, this process its caller, whose attempt's directory holds a damaged ranks.json.
    run = records.RunRecord.create("damaged", kind=records.BLOCKING, world_size=1, owner=True)
    attempt = RunPaths.create("damaged", run_id=run.id)
    try:
        run.attempt(attempt.directory)
        directory = attempt.directory
        if record == b"link":
            # A valid record elsewhere, naming a process that is not a rank: never followed, never signalled.
            target = tmp_path / "ranks.json"
            target.write_text(json.dumps({"host": socket.gethostname(), "ranks": [[2**22 + 1, None]]}))  # above pid_max
            (directory / "ranks.json").symlink_to(target)
        else:
            write_private(directory / "ranks.json", record.replace(b"%s", socket.gethostname().encode()))
        stacks = cli("stacks", run.id)
    finally:
        attempt.close()
        run.release()
    assert stacks.returncode == 2, stacks
    assert stacks.stderr.startswith(f"fanrun: run {run.id}: its ranks.json is damaged"), stacks.stderr
    assert len(stacks.stderr.splitlines()) == 1 and stacks.stdout == ""


def test_no_control_sequence_of_a_rank_reaches_the_terminal_through_list_logs_or_attach(runs_root):
    run = hostile_rank.distributed()
    assert run.wait(timeout=60) == "FAILED"
    assert "boom" in run.info["reason"] and "\x1b" in run.info["reason"]  # recorded as it was raised
    for command in (["list", "--all"], ["logs", run.id], ["logs", run.id, "-f"], ["logs", run.id, "--rank", "0"],
                    ["attach", run.id], ["cancel", run.id]):
        shown = cli(*command)
        for text in (shown.stdout, shown.stderr):
            assert not CONTROL.search(text), (command, text)
        assert "boom" in shown.stdout + shown.stderr, command
    logs = cli("logs", run.id).stdout
    assert "before||||\\x07|\\x00\tafter" in logs  # the sequences go, and a lone control shows as text


def test_printable_drops_every_control_sequence_and_keeps_what_it_is_told_to():
    assert printable("a\x1b]0;title\x07b\x1b]2;t\x1b\\c") == "abc"
    assert printable("x\x1b[6ny\x9b6nz\x1b[1;31mred\x1b[0m") == "xyzred"
    assert printable("\x9d0;title\x9cok\x90dcs\x9c.") == "ok."
    assert printable("keep\n\t\rdrop\x7f\x85\x1bc") == "keep\n\t\rdrop\\x7f\\x85"
    assert printable("one\nline\t\r", keep="") == "one\\x0aline\\x09\\x0d"
    assert printable("lone escape at the end\x1b") == "lone escape at the end"
    assert printable("unicode stays: é ü 日本") == "unicode stays: é ü 日本"


def test_fanrun_list_has_a_header_and_aligned_columns(runs_root):
    short, long = quick.distributed(), a_run_with_a_much_longer_name.distributed()
    assert short.wait(timeout=60) == long.wait(timeout=60) == "FINISHED"
    lines = cli("list", "--all").stdout.splitlines()
    assert lines[0].split() == ["RUN", "STATUS", "STARTED", "TOOK", "WHY"]
    assert sorted(line.split()[0] for line in lines[1:]) == sorted([short.id, long.id])
    for column in ("STATUS", "STARTED"):
        at = lines[0].index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in lines[1:]), lines
    took = lines[0].index("TOOK") + len("TOOK")
    assert all(line[took - 2:took] == " s" for line in lines[1:]), lines  # right-aligned under its header
