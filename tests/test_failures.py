"""What the caller sees when a rank fails: each failure of the contract, made to happen."""

from __future__ import annotations

import threading
import time

import pytest

import fanrun
from fanrun import distributed
from fanrun._errors import RemoteTraceback


class CustomError(Exception):
    def __init__(self, message, code):
        super().__init__(message, code)
        self.code = code


@distributed(num_accelerators=3)
def rank_one_raises(kind: str):
    import os
    import time

    if os.environ["RANK"] == "1":
        if kind == "value":
            raise ValueError("the data is bad")
        if kind == "custom":
            raise CustomError("custom trouble", 42)
        if kind == "unpicklable":

            class LocalError(Exception):
                def __init__(self):  # cannot be re-created from its args
                    super().__init__("local trouble", threading_lock())

            raise LocalError()
    time.sleep(60)  # the others would wait for a collective that never comes


def threading_lock():
    import threading

    return threading.Lock()


def test_exception_is_reraised_with_its_type_rank_and_remote_traceback():
    started = time.monotonic()
    with pytest.raises(ValueError) as caught:
        rank_one_raises.distributed("value")
    assert time.monotonic() - started < 20  # the sleeping ranks were stopped, not waited for
    error = caught.value
    assert str(error) == "[rank 1] the data is bad"
    assert isinstance(error.__cause__, RemoteTraceback)
    remote = str(error.__cause__)
    assert "Traceback from rank 1" in remote
    assert 'raise ValueError("the data is bad")' in remote  # the source line, looked up in the caller
    assert any("raised on rank 1 of 3" in note for note in error.__notes__)


def test_custom_exception_keeps_its_type_and_attributes():
    with pytest.raises(CustomError) as caught:
        rank_one_raises.distributed("custom")
    assert caught.value.code == 42
    assert caught.value.args[0] == "custom trouble"


def test_exception_that_cannot_be_recreated_is_reported_by_name():
    with pytest.raises(fanrun.RankFailedError, match=r"Rank 1 of 3 \(pid \d+\) raised .*LocalError: .*local trouble") as caught:
        rank_one_raises.distributed("unpicklable")
    assert caught.value.rank == 1
    assert isinstance(caught.value.__cause__, RemoteTraceback)


def test_exit_code_is_reported_with_the_stderr_tail():
    @distributed(num_accelerators=2)
    def exits():
        import os
        import sys
        import time

        if os.environ["RANK"] == "0":
            print("about to exit badly", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(60)

    with pytest.raises(fanrun.RankFailedError, match=r"Rank 0 of 2 \(pid \d+\) exited with code 3") as caught:
        exits.distributed()
    error = caught.value
    assert error.exit_code == 3 and error.rank == 0
    assert "about to exit badly" in str(error)
    assert error.log_path.endswith("rank_0.log")


def test_sigkill_suggests_the_oom_killer():
    @distributed(num_accelerators=2)
    def killed():
        import os
        import signal
        import time

        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    with pytest.raises(fanrun.RankFailedError, match=r"Rank 1 of 2 \(pid \d+\) was killed by SIGKILL; the kernel's out-of-memory killer is a likely cause") as caught:
        killed.distributed()
    assert caught.value.signal_name == "SIGKILL"


def test_segfault_shows_the_python_stack_from_faulthandler():
    @distributed(num_accelerators=1)
    def crashes():
        import ctypes

        ctypes.string_at(0)

    with pytest.raises(fanrun.RankFailedError, match="killed by SIGSEGV, a crash in native code") as caught:
        crashes.distributed()
    assert "Fatal Python error: Segmentation fault" in str(caught.value)


def test_sys_exit_with_a_code_is_a_failure_and_without_is_a_return():
    @distributed(num_accelerators=2)
    def leaves(code):
        import sys

        sys.exit(code)

    assert leaves.distributed(0) == [None, None]
    with pytest.raises(fanrun.RankFailedError, match=r"called sys.exit\(4\)") as caught:
        leaves.distributed(4)
    assert caught.value.exit_code == 4


def test_exit_without_a_result_is_reported():
    @distributed(num_accelerators=1)
    def vanishes():
        import os

        os._exit(0)

    with pytest.raises(fanrun.RankFailedError, match="exited with code 0 without returning a result"):
        vanishes.distributed()


def test_timeout_dumps_every_stack_then_names_the_running_ranks():
    # Long enough for both ranks to reach the function on a loaded machine: their stacks must show it.
    @distributed(num_accelerators=2, timeout=6)
    def hangs_in_a_named_place():
        import time

        def waiting_for_a_collective_that_never_comes():
            time.sleep(120)

        waiting_for_a_collective_that_never_comes()

    started = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        hangs_in_a_named_place.distributed()
    assert time.monotonic() - started < 30
    error = caught.value
    assert isinstance(error, fanrun.RunTimeoutError)
    assert error.running_ranks == [0, 1]
    assert "timed out after 6 s; ranks still running: 0, 1" in str(error)
    for rank in (0, 1):
        assert any("waiting_for_a_collective_that_never_comes" in line for line in error.stacks[rank])


def test_unpicklable_argument_is_named_before_any_process_starts(runs_dir):
    before = set(runs_dir.iterdir())

    @distributed(num_accelerators=2)
    def uses(resource):
        return 1

    with pytest.raises(fanrun.PayloadSerializationError, match=r"positional argument 0 is a _thread.lock, which cannot be pickled.*Create it inside the function"):
        uses.distributed(threading.Lock())
    with pytest.raises(fanrun.PayloadSerializationError, match=r"argument 'resource' is a _thread.lock"):
        uses.distributed(resource=threading.Lock())
    assert set(runs_dir.iterdir()) == before


def test_unpicklable_captured_variable_is_named():
    lock = threading.Lock()

    @distributed(num_accelerators=2)
    def captures():
        with lock:
            return 1

    with pytest.raises(TypeError, match=r"the variable 'lock' captured by .*captures' is a _thread.lock"):
        captures.distributed()


def test_unpicklable_return_value_names_the_rank_and_type():
    @distributed(num_accelerators=2)
    def returns_a_lock():
        import os
        import threading

        return threading.Lock() if os.environ["RANK"] == "1" else 0

    with pytest.raises(fanrun.ResultSerializationError, match=r"Rank 1 returned a value of type _thread.lock that cannot be pickled") as caught:
        returns_a_lock.distributed()
    assert caught.value.rank == 1
    assert isinstance(caught.value, TypeError)


def test_missing_executable_is_an_error_before_the_run(monkeypatch):
    from fanrun._launch import call
    from fanrun._spec.program import RankProgram
    from fanrun._spec.spec import Options

    spec = call.plan("x", Options(num_accelerators=2, accelerator=None, timeout=None, leave_mlflow_alone=True),
                     RankProgram.native(["/nonexistent/python"]))
    with pytest.raises(fanrun.ExecutableNotFoundError, match="Rank 0 could not start: Cannot run '/nonexistent/python'"):
        call.run(spec)


GPU_SEED_CODE = """
from fanrun import distributed

@distributed({arguments})
def run_train(backend):
    import os, torch, torch.distributed as dist
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    dist.destroy_process_group()
    return 1

print(run_train.distributed({backend!r}))
"""


def run_seed_code(tmp_path, arguments: str, backend: str):
    import subprocess
    import sys

    script = tmp_path / "seed.py"
    script.write_text(GPU_SEED_CODE.format(arguments=arguments, backend=backend))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120)


@pytest.mark.skipif(fanrun._accelerators.detect().visible, reason="needs a machine without a GPU")
def test_gpu_code_on_a_cpu_machine_says_why_and_what_to_do(tmp_path):
    """Databricks' seed code unchanged (set_device, NCCL) where there is no GPU: one line says what
    was started, and the root cause keeps its type with a note that names gloo."""
    done = run_seed_code(tmp_path, "", "nccl")
    assert done.returncode == 1
    assert done.stderr.startswith('fanrun: no GPU found: 2 CPU processes; use the gloo backend (init_process_group("gloo"))\n')
    assert "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'" in done.stderr
    assert 'fanrun: the ranks are 2 CPU processes, with no GPU, and this failed on a CUDA call or on NCCL. ' \
           'Use init_process_group("gloo")' in done.stderr


@pytest.mark.skipif(fanrun._accelerators.detect().visible, reason="needs a machine without a GPU")
def test_nccl_on_cpu_ranks_keeps_its_type_and_gets_the_hint():
    @distributed(num_accelerators=2)
    def nccl_only():
        import torch.distributed as dist

        dist.init_process_group("nccl")

    with pytest.raises(RuntimeError, match="NCCL") as caught:
        nccl_only.distributed()
    assert any('Use init_process_group("gloo")' in note for note in caught.value.__notes__)
    assert isinstance(caught.value.__cause__, RemoteTraceback)


def test_cpu_asked_for_or_gloo_used_brings_no_notice(tmp_path):
    done = run_seed_code(tmp_path, 'accelerator_type="CPU"', "gloo")
    assert done.returncode == 0, done.stderr
    assert "no GPU found" not in done.stderr and "[1, 1]" in done.stdout


def fanrun_frames(error: BaseException) -> list[str]:
    import os
    import traceback

    package = os.path.dirname(fanrun.__file__) + os.sep
    return [f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_tb(error.__traceback__)
            if frame.filename.startswith(package)]


def test_the_raised_error_shows_the_callers_frames_and_none_of_fanruns():
    @distributed(num_accelerators=2, tracking=False)
    def fails():
        raise ValueError("the data is bad")

    with pytest.raises(ValueError, match=r"\[rank \d\] the data is bad") as caught:
        fails.distributed()
    assert fanrun_frames(caught.value) == []
    assert isinstance(caught.value.__cause__, RemoteTraceback)  # the rank's own traceback stays
    # An error found before any rank starts, too.
    with pytest.raises(TypeError, match="cannot take the arguments") as caught:
        fails.distributed(1)
    assert fanrun_frames(caught.value) == []


def run_caller(tmp_path, code: str):
    import subprocess
    import sys

    script = tmp_path / "caller.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_a_count_given_brings_no_gpu_notice(tmp_path):
    # The notice comes from the plan, before any rank runs: what the ranks do (gloo or not) is not its business.
    done = run_caller(tmp_path, "from fanrun import distributed\n\n@distributed(num_accelerators=2, tracking=False)\n"
                                "def one():\n    return 1\n\nprint(one.distributed())\n")
    assert done.returncode == 0, done.stderr
    assert "no GPU found" not in done.stderr and "[1, 1]" in done.stdout


@pytest.mark.skipif(fanrun._accelerators.detect().visible, reason="needs a machine without a GPU")
def test_the_no_gpu_notice_comes_once_per_process(tmp_path):
    done = run_caller(tmp_path, "from fanrun import distributed\n\n@distributed(tracking=False)\ndef one():\n"
                                "    return 1\n\nprint(one.distributed(), one.distributed())\n")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("no GPU found") == 1, done.stderr


def test_more_cpu_ranks_than_cores_warns_once_in_one_line(tmp_path):
    import os

    cores = len(os.sched_getaffinity(0))
    done = run_caller(tmp_path, f"from fanrun import distributed\n\n@distributed({cores + 1}, accelerator_type='CPU', "
                                f"tracking=False)\ndef one():\n    return 1\n\nprint(one.distributed(), one.distributed())\n")
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "share the" in line]
    assert warned == [f"fanrun: {cores + 1} CPU processes share the {cores} cores this process may use, so each runs "
                      f"slower than one alone and a collective waits for the slowest; ask for at most {cores}"], done.stderr


def test_torchs_nccl_error_where_no_gpu_is_visible_gets_the_gloo_hint():
    # What a CUDA build of torch (2.11+cu130) raises for init_process_group("nccl") where no GPU is visible.
    @distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
    def nccl_without_gpus():
        raise ValueError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")

    with pytest.raises(ValueError, match="ProcessGroupNCCL is only supported with GPUs") as caught:
        nccl_without_gpus.distributed()
    assert any('Use init_process_group("gloo")' in note for note in caught.value.__notes__)
