"""The launch fault matrix: a rank that misbehaves, a caller that dies, a machine that is asked
too much. Each test is one row of docs/reliability.md and says the promise it proves."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import fanrun
from fanrun import distributed
from fanrun._errors import RemoteTraceback
from processes import is_zombie, wait_gone

FANRUN = [sys.executable, "-m", "fanrun"]
# Every process a test's ranks start carries this variable, so /proc finds them all.
TAG = "FANRUN_FAULT_TEST_TAG"


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds this test's tag."""
    marker = f"{TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                if marker in file.read().split(b"\0") and not is_zombie(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture
def tag(monkeypatch):
    """A unique tag in the environment the ranks inherit; whatever still carries it at the end
    is killed, so that a failing test leaves nothing behind."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(TAG, value)
    yield value
    for pid in tagged(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wait_gone(tagged(value), timeout=10) == []


def start_children() -> list[int]:
    """Runs in a rank: starts `sleep 301` three ways (a plain child, one in a new session, one
    double-forked into a session of its own) and returns their pids once each runs."""
    import os
    import subprocess

    plain = subprocess.Popen(["sleep", "301"])
    session = subprocess.Popen(["sleep", "301"], start_new_session=True)
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.execvp("sleep", ["sleep", "301"])
        os.write(write_end, str(daemon).encode())
        os._exit(0)
    os.close(write_end)
    daemon = int(os.read(read_end, 64))
    os.close(read_end)
    os.waitpid(middle, 0)
    pids = [plain.pid, session.pid, daemon]
    for pid in pids:  # each has exec'd sleep before this returns
        while open(f"/proc/{pid}/cmdline", "rb").read() != b"sleep\x00301\x00":
            time.sleep(0.01)
    return pids


def assert_started_and_gone(tag: str, pids: list[int]) -> None:
    assert len(pids) == 6
    left = tagged(tag)
    assert left == [], f"processes the ranks started outlived the run: {left}"


# ---------------------------------------------------------------- a rank ends without returning


def test_exit_0_without_returning_stops_the_run_at_once():
    """A rank that exits with code 0 without having returned (os._exit(0)) is the root cause the
    moment it exits: the others are stopped, and the error names the rank."""

    @distributed(num_accelerators=2)
    def one_vanishes():
        import os
        import time

        if os.environ["RANK"] == "1":
            os._exit(0)
        time.sleep(60)

    started = time.monotonic()
    with pytest.raises(fanrun.RankFailedError, match=r"Rank 1 of 2 \(pid \d+\) exited with code 0 without returning a result") as caught:
        one_vanishes.distributed()
    assert time.monotonic() - started < 10  # not the 60 s the other rank sleeps
    assert caught.value.rank == 1 and caught.value.exit_code == 0


def test_sys_exit_0_in_the_function_is_a_return():
    """sys.exit(0) (or sys.exit()) inside the function is a return of None, as before."""

    @distributed(num_accelerators=2)
    def leaves():
        import sys

        sys.exit(0)

    assert leaves.distributed() == [None, None]


@pytest.mark.parametrize("ending", ["import sys; sys.exit(0)", "import os; os._exit(0)", "pass"])
def test_a_script_that_exits_0_succeeds(tmp_path, ending):
    """For `fanrun run`, a script's exit code 0 is success, however it exits."""
    script = tmp_path / "job.py"
    script.write_text(f"print('ran', flush=True)\n{ending}\n")
    done = subprocess.run(FANRUN + ["run", "-n", "2", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank0]: ran", "[rank1]: ran"]


# ---------------------------------------------------------------- nothing a rank starts outlives the run


@distributed(num_accelerators=2)
def start_children_then(ending: str):
    import os
    import time

    pids = start_children()
    if ending == "rank 1 raises" and os.environ["RANK"] == "1":
        raise RuntimeError(f"failing after starting {pids}")
    if ending in ("rank 1 raises", "sleep"):
        time.sleep(120)
    return pids


def test_no_process_a_rank_started_outlives_a_normal_end(tag):
    """After a normal end, every process the ranks started is gone: plain children, children in
    a new session, double-forked daemons."""
    results = start_children_then.distributed("return")
    assert_started_and_gone(tag, results[0] + results[1])


def test_no_process_a_rank_started_outlives_a_rank_failure(tag):
    """After a rank fails, the processes every rank started are gone when the error is raised."""
    with pytest.raises(RuntimeError, match=r"failing after starting \[(\d+), (\d+), (\d+)\]"):
        start_children_then.distributed("rank 1 raises")
    assert tagged(tag) == []


def test_no_process_a_rank_started_outlives_a_timeout(tag):
    """After a timeout, the processes the ranks started are gone when TimeoutError is raised."""
    timed = distributed(num_accelerators=2, timeout=5)(start_children_then._fn)
    with pytest.raises(fanrun.RunTimeoutError):
        timed.distributed("sleep")
    assert tagged(tag) == []


CALLER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from test_faults_launch import start_children
    from fanrun import distributed

    @distributed(num_accelerators=2)
    def wait_forever():
        print("pids", os.getpid(), *start_children(), flush=True)
        time.sleep(300)

    try:
        wait_forever.distributed()
    except KeyboardInterrupt:
        print("caller: interrupted", flush=True)
    """
)


def start_caller(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(CALLER.format(tests=os.path.dirname(__file__)))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    lines = []
    while len(pids) < 8:
        line = caller.stdout.readline()
        if not line:
            caller.wait(10)
            pytest.fail(f"caller ended before the ranks started: {lines} {caller.stderr.read()}")
        lines.append(line)
        match = re.match(r"\[rank\d\]: pids ([\d ]+)$", line.strip())
        if match:
            pids += [int(p) for p in match.group(1).split()]
    return caller, pids


def test_no_process_of_a_run_outlives_a_sigkill_of_its_caller(tmp_path, tag):
    """The caller killed with SIGKILL: its ranks and everything they started die with it."""
    caller, pids = start_caller(tmp_path)
    assert len(tagged(tag)) >= 8
    caller.kill()
    caller.wait(10)
    caller.stdout.close()
    caller.stderr.close()
    assert wait_gone(pids, timeout=10) == []
    assert wait_gone(tagged(tag), timeout=10) == []


def test_ctrl_c_stops_every_rank_and_everything_it_started(tmp_path, tag):
    """Ctrl+C (SIGINT) in the caller: every rank and every process it started is stopped before
    KeyboardInterrupt reaches the caller's code."""
    caller, pids = start_caller(tmp_path)
    caller.send_signal(signal.SIGINT)
    out, err = caller.communicate(timeout=60)
    assert caller.returncode == 0, err
    assert "caller: interrupted" in out
    assert wait_gone(pids, timeout=0.5) == []
    assert tagged(tag) == []


# ---------------------------------------------------------------- failures that already held


def test_a_rank_that_raises_is_the_root_cause_and_the_others_stop():
    """A rank raises: the caller gets the same exception type, labelled with the rank, its
    traceback chained, without waiting for the other ranks."""

    @distributed(num_accelerators=2)
    def rank_one_raises():
        import os
        import time

        if os.environ["RANK"] == "1":
            raise ValueError("bad data")
        time.sleep(60)

    started = time.monotonic()
    with pytest.raises(ValueError, match=r"^\[rank 1\] bad data") as caught:
        rank_one_raises.distributed()
    assert time.monotonic() - started < 20
    assert 'raise ValueError("bad data")' in str(caught.value.__cause__)


def test_a_rank_killed_by_sigkill_is_named():
    """A rank killed by SIGKILL: RankFailedError names the rank, the signal and the OOM killer."""

    @distributed(num_accelerators=2)
    def killed():
        import os
        import signal
        import time

        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    with pytest.raises(fanrun.RankFailedError, match=r"Rank 0 of 2 \(pid \d+\) was killed by SIGKILL") as caught:
        killed.distributed()
    assert caught.value.signal_name == "SIGKILL"


@distributed(num_accelerators=3)
def all_reduce_until_rank_1_is_killed():
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(1000):
        dist.all_reduce(torch.ones(1000))
        if step == 20 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_mid_collective_is_the_root_cause_not_its_peers_connection_errors():
    """Its peers' all-reduce fails with "connection reset by peer" at once, and their reports
    can reach the supervisor before the killed rank's keeper has reported its death."""
    for _ in range(3):
        with pytest.raises(fanrun.RankFailedError, match=r"^Rank 1 of 3 \(pid \d+\) was killed by SIGKILL") as caught:
            all_reduce_until_rank_1_is_killed.distributed()
        assert caught.value.rank == 1


def test_a_rank_that_closed_stderr_and_raised_gets_its_exception_back():
    """A rank that closed fd 2 and then raised: the caller still gets its exception and
    traceback, which travel in the error file, not through stderr."""

    @distributed(num_accelerators=2)
    def closes_stderr():
        import os
        import time

        if os.environ["RANK"] == "1":
            os.close(2)
            raise ValueError("after closing stderr")
        time.sleep(60)

    with pytest.raises(ValueError) as caught:
        closes_stderr.distributed()
    assert caught.value.args == ("[rank 1] after closing stderr",)
    assert isinstance(caught.value.__cause__, RemoteTraceback)
    assert 'raise ValueError("after closing stderr")' in str(caught.value.__cause__)


# ---------------------------------------------------------------- timeouts and their stacks


def test_a_timeout_dumps_every_python_stack():
    """At a timeout every rank's Python stack is dumped and named in the error."""

    @distributed(num_accelerators=2, timeout=6)
    def hangs():
        import time

        def waiting_in_a_named_place():
            time.sleep(120)

        waiting_in_a_named_place()

    with pytest.raises(fanrun.RunTimeoutError) as caught:
        hangs.distributed()
    message = str(caught.value)
    assert "Python stacks dumped before the kill: ranks 0, 1." in message
    assert "No stack" not in message
    for rank in (0, 1):
        assert any("waiting_in_a_named_place" in line for line in caught.value.stacks[rank])
    assert caught.value.missing_stacks == {}


def test_a_timeout_names_the_rank_whose_stack_could_not_be_dumped():
    """A rank that blocks the stack-dump signal cannot dump its stack: the error says which
    ranks' stacks were dumped, which were not, and why."""

    # Unwatched (on_stall=None): a watched rank has a thread of fanrun's, started before the
    # function, where the signal still lands, and its stack is dumped after all.
    @distributed(num_accelerators=2, timeout=6, on_stall=None)
    def one_blocks_the_dump():
        import os
        import signal
        import time

        if os.environ["RANK"] == "1":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        time.sleep(120)

    with pytest.raises(fanrun.RunTimeoutError) as caught:
        one_blocks_the_dump.distributed()
    message = str(caught.value)
    assert "Every rank's Python stack was dumped" not in message
    assert "Python stacks dumped before the kill: rank 0." in message
    assert "No stack from rank 1: it blocks SIGUSR2 in every thread." in message
    assert set(caught.value.stacks) == {0}
    assert caught.value.missing_stacks == {1: "it blocks SIGUSR2 in every thread"}


def test_a_timeout_of_a_native_program_says_there_is_no_python_stack():
    """`fanrun run --no-python` at a timeout: no Python stack exists, and the error says so."""
    done = subprocess.run(FANRUN + ["run", "-n", "2", "--timeout", "2", "--no-python", "sleep", "60"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 124
    assert "Every rank's Python stack was dumped" not in done.stderr
    assert "No stack from ranks 0, 1: a native program has no Python stack to dump." in done.stderr


# ---------------------------------------------------------------- refused before anything starts


def test_far_more_cpu_ranks_than_cores_are_refused_at_once(tmp_path):
    """num_accelerators=10**6 on a machine without GPUs is refused in the caller, at once, with
    the limit and its override named, and no run directory is made."""
    runs = tmp_path / "runs"
    caller = tmp_path / "caller.py"
    caller.write_text(textwrap.dedent(
        """
        import resource, sys
        # Without the check, the caller grows by gigabytes: keep that from hurting the machine.
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.RLIM_INFINITY))
        from fanrun import distributed, AcceleratorMismatchError

        @distributed(num_accelerators=10**6)
        def f():
            return 1

        try:
            f.distributed()
        except AcceleratorMismatchError as error:
            print("refused:", error)
        """
    ))
    env = {**os.environ, "FANRUN_RUNS_DIR": str(runs), "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(caller)], capture_output=True, text=True, timeout=120, env=env)
    assert time.monotonic() - started < 30
    assert done.returncode == 0, done.stderr[-2000:]
    cores = len(os.sched_getaffinity(0))
    assert f"num_accelerators=1000000 CPU processes is more than this machine allows: {4 * cores}" in done.stdout
    assert "FANRUN_MAX_CPU_RANKS" in done.stdout
    assert not runs.exists() or not any(runs.iterdir())


def test_the_cpu_rank_limit_is_four_per_core_and_can_be_changed(monkeypatch):
    """The default limit is 4 CPU ranks per core; FANRUN_MAX_CPU_RANKS moves it, and a bad value
    is named."""
    from fanrun import _accelerators

    cpu = _accelerators.parse_accelerator_type("CPU")
    inventory = _accelerators.detect()
    limit = 4 * len(os.sched_getaffinity(0))
    assert _accelerators.plan_run(limit, cpu, inventory).world_size == limit
    with pytest.raises(fanrun.AcceleratorMismatchError, match=f"more than this machine allows: {limit}"):
        _accelerators.plan_run(limit + 1, cpu, inventory)
    monkeypatch.setenv("FANRUN_MAX_CPU_RANKS", str(limit + 1))
    assert _accelerators.plan_run(limit + 1, cpu, inventory).world_size == limit + 1
    monkeypatch.setenv("FANRUN_MAX_CPU_RANKS", "1")

    @distributed(num_accelerators=2)
    def two():
        return 1

    with pytest.raises(fanrun.AcceleratorMismatchError, match=r"FANRUN_MAX_CPU_RANKS=1"):
        two.distributed()
    monkeypatch.setenv("FANRUN_MAX_CPU_RANKS", "many")
    with pytest.raises(ValueError, match=r"FANRUN_MAX_CPU_RANKS must be a positive whole number, not 'many'"):
        two.distributed()


DELETED_CWD_CALLER = textwrap.dedent(
    """
    import os, tempfile
    from fanrun import distributed

    @distributed(num_accelerators=2)
    def f():
        return 1

    gone = tempfile.mkdtemp()
    os.chdir(gone)
    os.rmdir(gone)
    try:
        f.distributed()
    except FileNotFoundError as error:
        print("refused:", error)
        print("type:", type(error).__name__)
    """
)


def test_a_deleted_working_directory_is_a_clear_error(tmp_path):
    """The caller's working directory was deleted: a clear FileNotFoundError in the caller,
    before any rank starts or any run directory is made."""
    runs = tmp_path / "runs"
    caller = tmp_path / "caller.py"
    caller.write_text(DELETED_CWD_CALLER)
    env = {**os.environ, "FANRUN_RUNS_DIR": str(runs)}
    done = subprocess.run([sys.executable, str(caller)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: the working directory no longer exists (" in done.stdout
    assert "(deleted)" in done.stdout
    assert "type: WorkingDirectoryError" in done.stdout
    assert not runs.exists() or not any(runs.iterdir())


def test_a_deleted_working_directory_is_a_clear_error_for_fanrun_run(tmp_path):
    """The same for `fanrun run`: a one-line error and exit code 1."""
    gone = tmp_path / "gone"
    gone.mkdir()
    command = f'cd "{gone}" && rmdir "{gone}" && exec "$0" -m fanrun run -n 2 --no-python true'
    done = subprocess.run(["sh", "-c", command, sys.executable], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "fanrun: WorkingDirectoryError: the working directory no longer exists (" in done.stderr


LOW_FD_CALLER = textwrap.dedent(
    """
    import resource
    from fanrun import distributed

    @distributed(num_accelerators=2)
    def f():
        return 1

    resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        f.distributed()
    except OSError as error:
        print("refused:", error)
        print("type:", type(error).__name__)
    """
)


def test_too_few_file_descriptors_are_named_before_any_rank_starts(tmp_path):
    """A descriptor limit too low for the run: the error names RLIMIT_NOFILE, its value and
    `ulimit -n`, before any rank starts."""
    runs = tmp_path / "runs"
    caller = tmp_path / "caller.py"
    caller.write_text(LOW_FD_CALLER)
    env = {**os.environ, "FANRUN_RUNS_DIR": str(runs)}
    done = subprocess.run([sys.executable, str(caller)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout
    assert "RLIMIT_NOFILE" in done.stdout and "is 40" in done.stdout and "ulimit -n" in done.stdout
    assert "type: DescriptorLimitError" in done.stdout
    assert not runs.exists() or not any(runs.iterdir())
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert f"hard limit {hard}" in done.stdout or hard == resource.RLIM_INFINITY
