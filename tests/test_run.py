"""Running a function on every rank: results, environment, what travels, runs side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import fanrun
from fanrun import distributed
from fanrun._spec import paths as _paths

TORCHRUN_VARIABLES = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
]


@distributed(num_accelerators=3)
def rank_environment():
    import os
    import sys

    return {
        "env": {k: os.environ.get(k) for k in TORCHRUN_VARIABLES + ["OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "FANRUN_TEST_MARK"]},
        "cwd": os.getcwd(),
        "executable": sys.executable,
        "path_has_marker": "/fanrun-test-path-marker" in sys.path,
        "pid": os.getpid(),
    }


def test_results_come_back_in_rank_order_with_torchrun_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FANRUN_TEST_MARK", "inherited")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("/fanrun-test-path-marker")
    results = rank_environment.distributed()
    assert [r["env"]["RANK"] for r in results] == ["0", "1", "2"]
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    pids = {r["pid"] for r in results}
    assert len(pids) == 3 and os.getpid() not in pids
    for rank, r in enumerate(results):
        assert r["env"]["LOCAL_RANK"] == str(rank) and r["env"]["ROLE_RANK"] == str(rank)
        assert r["env"]["WORLD_SIZE"] == r["env"]["LOCAL_WORLD_SIZE"] == "3"
        assert r["env"]["GROUP_RANK"] == r["env"]["NODE_RANK"] == "0"
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert r["env"]["OMP_NUM_THREADS"] == "1"
        assert r["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert r["env"]["FANRUN_TEST_MARK"] == "inherited"
        assert r["cwd"] == str(tmp_path)
        assert r["executable"] == sys.executable
        assert r["path_has_marker"]


def test_callers_own_thread_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    env = rank_environment.distributed()[0]["env"]
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_arguments_and_closures_travel():
    scale = 10

    @distributed(num_accelerators=2)
    def scaled(values, *, offset):
        import os

        return [v * scale + offset + int(os.environ["RANK"]) for v in values]

    assert scaled.distributed([1, 2], offset=5) == [[15, 25], [16, 26]]


def test_function_and_class_defined_in_main(tmp_path):
    script = tmp_path / "notebook_like.py"
    script.write_text(textwrap.dedent(
        """
        from fanrun import distributed

        class Accumulator:
            def __init__(self, start):
                self.total = start
            def add(self, value):
                self.total += value
                return self

        def helper(x):
            return x * 2

        @distributed(num_accelerators=2)
        def run(start):
            import os
            return Accumulator(start).add(helper(int(os.environ["RANK"])))

        results = run.distributed(100)
        print(type(results[0]).__name__, [r.total for r in results])
        """
    ))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "Accumulator [100, 102]"


def test_large_return_values_arrive_whole():
    @distributed(num_accelerators=2)
    def big():
        import os

        rank = int(os.environ["RANK"])
        return bytes([rank]) * (200 * 1024 * 1024)

    results = big.distributed()
    assert [len(r) for r in results] == [200 * 1024 * 1024] * 2
    assert results[0][:1] == b"\x00" and results[1][-1:] == b"\x01"


def test_large_argument_is_sent_once_and_read_by_every_rank():
    blob = os.urandom(64 * 1024 * 1024)

    @distributed(num_accelerators=2)
    def digest(data):
        import hashlib

        return hashlib.sha256(data).hexdigest()

    import hashlib

    assert digest.distributed(blob) == [hashlib.sha256(blob).hexdigest()] * 2


def test_two_calls_at_once_get_their_own_ports_and_results():
    @distributed(num_accelerators=2)
    def all_reduce(value):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([value + dist.get_rank()])
        dist.all_reduce(t)
        port = os.environ["MASTER_PORT"]
        dist.destroy_process_group()
        return int(t.item()), port

    outcomes: dict[int, object] = {}

    def call(value):
        try:
            outcomes[value] = all_reduce.distributed(value)
        except BaseException as error:  # reported below
            outcomes[value] = error

    threads = [threading.Thread(target=call, args=(v,)) for v in (10, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r[0] for r in outcomes[10]] == [21, 21]
    assert [r[0] for r in outcomes[1000]] == [2001, 2001]
    assert outcomes[10][0][1] != outcomes[1000][0][1]


def test_results_files_are_private_and_removed(runs_dir):
    @distributed(num_accelerators=1)
    def where():
        import os
        import stat

        run_dir = os.environ["FANRUN_RUN_DIR"]
        return run_dir, stat.S_IMODE(os.stat(run_dir).st_mode), stat.S_IMODE(os.stat(run_dir + "/payload.pkl").st_mode)

    run_dir, dir_mode, payload_mode = where.distributed()[0]
    assert (dir_mode, payload_mode) == (0o700, 0o600)
    # Left: the marker, the log, and the stall watch's progress record, stacks file and FIFO.
    assert sorted(os.listdir(run_dir)) == [_paths.RUN_MARKER, "rank_0.ask", "rank_0.log", "rank_0.progress",
                                           "rank_0.stacks"]


def test_version_is_exposed():
    assert fanrun.__version__


def test_a_rank_ends_after_its_exit_work_without_the_interpreters_teardown(tmp_path):
    """A destructor that aborts while the interpreter is torn down (native ones in ranks of
    torch.distributed jobs have, after the function had returned) must not fail a call that
    returned; the exit work Python does before the teardown must still be done."""

    @distributed(num_accelerators=2)
    def returns_then_exits(out_dir):
        import atexit
        import builtins
        import os
        import threading
        import time

        rank = os.environ["RANK"]

        class AbortsWhenDestroyed:
            def __del__(self, abort=os.abort):
                abort()

        builtins.fanrun_test_object = AbortsWhenDestroyed()  # destroyed in the teardown only
        atexit.register(lambda: open(f"{out_dir}/atexit_{rank}", "w").close())
        # Left open, its buffered text is written only when it is flushed at exit.
        builtins.fanrun_test_file = open(f"{out_dir}/unclosed_{rank}", "w")
        builtins.fanrun_test_file.write("buffered")

        def late_writer():
            time.sleep(0.5)
            open(f"{out_dir}/thread_{rank}", "w").close()

        threading.Thread(target=late_writer).start()  # not a daemon: Python waits for it
        return rank

    assert returns_then_exits.distributed(str(tmp_path)) == ["0", "1"]
    for rank in (0, 1):
        assert (tmp_path / f"atexit_{rank}").exists()
        assert (tmp_path / f"thread_{rank}").exists()
        assert (tmp_path / f"unclosed_{rank}").read_text() == "buffered"


@distributed(num_accelerators=2, max_restarts=1, tracking=False)
def fails_once():
    import os

    if os.environ["RANK"] == "1" and os.environ["FANRUN_RESTART_COUNT"] == "0":
        raise RuntimeError("the first attempt fails")
    return os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["FANRUN_RESTART_COUNT"], os.environ["TORCHELASTIC_MAX_RESTARTS"]


def test_a_restarted_attempts_ranks_see_torchruns_and_fanruns_restart_count():
    assert fails_once.distributed() == [("1", "1", "1"), ("1", "1", "1")]


def test_a_large_global_is_named_with_its_size_and_what_to_do_instead(runs_dir):
    import warnings

    from fanrun._spec.payload import serialize_call

    # As in a notebook: a function of a module that cannot be imported travels by value, with its globals.
    cell = {"__name__": "a_notebook_cell", "LARGE_TABLE": bytes(120 * 1000 * 1000)}
    exec("def uses_the_large_table(rows):\n    return len(LARGE_TABLE) + rows\n", cell)
    uses_the_large_table = cell["uses_the_large_table"]
    with pytest.warns(fanrun.PayloadSizeWarning) as caught:
        serialize_call(uses_the_large_table, (3,), {})
    (warning,) = caught
    assert str(warning.message).startswith(
        "the call of 'uses_the_large_table' is 120 MB pickled, which every rank reads before it starts: the global "
        "'LARGE_TABLE' used by 'uses_the_large_table' is 120 MB. Load such data inside the function instead (pass its "
        "path"), str(warning.message)
    assert warning.filename == __file__  # the caller's line, not fanrun's
    # Through the decorator, before any rank starts (here, where the warning is made an error).
    before = set(runs_dir.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error", fanrun.PayloadSizeWarning)
        with pytest.raises(fanrun.PayloadSizeWarning, match=r"positional argument 0 is 120 MB"):
            distributed(num_accelerators=2, tracking=False)(len).distributed(cell["LARGE_TABLE"])
    assert set(runs_dir.iterdir()) == before
