"""Notebooks executed cell by cell in a real Jupyter kernel (ipykernel through nbclient)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from gpus import needs_gpus
from processes import wait_gone

from fanrun._launch import records

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from notebook_format import notebook_of  # noqa: E402


def stream_text(cell, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == name)


def run_notebook(path: Path, tmp_path: Path, monkeypatch) -> nbformat.NotebookNode:
    # As users run them: every call tracked, here in a store of the test's own.
    monkeypatch.delenv("FANRUN_TRACKING", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return notebook


@pytest.mark.parametrize("name", ["ddp_quickstart", "fsdp", "deepspeed_zero", "from_torchdistributor"])
def test_notebook_is_the_script(name):
    """The notebook in examples/ is exactly the importable script's cells."""
    script = notebook_of(EXAMPLES / f"{name}.py")
    notebook = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    assert [(c.cell_type, c.source) for c in notebook.cells] == [(c.cell_type, c.source) for c in script.cells]


def test_ddp_quickstart_in_a_kernel(tmp_path, monkeypatch):
    notebook = run_notebook(EXAMPLES / "ddp_quickstart.ipynb", tmp_path, monkeypatch)
    training_cell, check_cell = notebook.cells[-2], notebook.cells[-1]
    live = stream_text(training_cell)
    for rank in (0, 1):
        assert f"[rank{rank}]: epoch 0: loss" in live and f"[rank{rank}]: epoch 2: loss" in live
        assert f"rank {rank} on cpu: loss" in live or f"rank {rank} on cuda:{rank}: loss" in live
    assert "2 ranks trained; the loss went down on every one." in stream_text(check_cell)
    # The call's MLflow run, announced in the cell (as text: the store is a local sqlite file).
    assert "fanrun: MLflow run run_train-" in live and "fanrun ui --backend-store-uri sqlite:///" in live


def test_fsdp_in_a_kernel(tmp_path, monkeypatch):
    notebook = run_notebook(EXAMPLES / "fsdp.ipynb", tmp_path, monkeypatch)
    training_cell, check_cell = notebook.cells[-2], notebook.cells[-1]
    live = stream_text(training_cell)
    for wrapper in ("fully_shard", "FullyShardedDataParallel"):
        assert f"[rank0]: {wrapper} step 0: loss" in live
        for rank in (0, 1):
            assert f"{wrapper} rank {rank}: loss" in live and "restored model differs by 0.00e+00" in live
    assert "FSDP2 and FSDP1 trained; both checkpoints restored exactly." in stream_text(check_cell)


def test_deepspeed_zero_in_a_kernel(tmp_path, monkeypatch):
    notebook = run_notebook(EXAMPLES / "deepspeed_zero.ipynb", tmp_path, monkeypatch)
    training_cell, check_cell = notebook.cells[-2], notebook.cells[-1]
    live = stream_text(training_cell)
    for stage in (2, 3):
        assert f"[rank0]: ZeRO-{stage} step 0: loss" in live
        for rank in (0, 1):
            assert f"ZeRO-{stage} rank {rank}: loss" in live
    assert "ZeRO-2 and ZeRO-3 trained; both checkpoints restored exactly." in stream_text(check_cell)


def test_from_torchdistributor_in_a_kernel(tmp_path, monkeypatch):
    notebook = run_notebook(EXAMPLES / "from_torchdistributor.ipynb", tmp_path, monkeypatch)
    spark_form, fanrun_form, check = notebook.cells[-3], notebook.cells[-2], notebook.cells[-1]
    assert "[rank1]: rank 1: loss" in stream_text(spark_form)
    assert "TorchDistributor returned {'rank': 0," in stream_text(spark_form)
    assert "@distributed returned [{'rank': 0," in stream_text(fanrun_form)
    assert "TorchDistributor returned rank 0's result." in stream_text(check)


def test_kernel_interrupt_stops_every_rank_and_keeps_the_kernel(tmp_path, monkeypatch):
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("FANRUN_TEST_PID_FILE", str(pid_file))
    notebook = nbformat.read(Path(__file__).parent / "notebooks" / "interrupt.ipynb", as_version=4)
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", allow_errors=True)

    async def scenario() -> list[int]:
        async with client.async_setup_kernel():
            await client.async_execute_cell(notebook.cells[0], 0)
            running = asyncio.ensure_future(client.async_execute_cell(notebook.cells[1], 1))
            deadline = time.monotonic() + 60
            while len(pid_file.read_text().split() if pid_file.exists() else []) < 2:
                assert time.monotonic() < deadline, "the ranks never started"
                assert not running.done(), notebook.cells[1].outputs
                await asyncio.sleep(0.1)
            pids = [int(p) for p in pid_file.read_text().split()]
            await client.km.interrupt_kernel()
            await asyncio.wait_for(running, 60)
            await client.async_execute_cell(notebook.cells[2], 2)
            return pids

    pids = asyncio.run(scenario())
    errors = [o for o in notebook.cells[1].outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["KeyboardInterrupt"]
    assert "[rank0]: rank waiting 0" in stream_text(notebook.cells[1])
    assert stream_text(notebook.cells[2]) == "after the interrupt: [10, 11]\n"
    assert wait_gone(pids, timeout=5) == []


CUDA_FIRST_CELLS = [
    # The kernel itself holds a CUDA context, as after any GPU work in a notebook: launchers
    # that fork the kernel fail here ("Cannot re-initialize CUDA in forked subprocess").
    "import torch\nheld = torch.ones(1024, 1024, device='cuda')\nprint('kernel CUDA context:', held.device)",
    """from fanrun import distributed

@distributed(num_accelerators=2)
def all_reduce_on_gpus():
    import os
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    total = torch.tensor([dist.get_rank() + 1.0], device="cuda")
    dist.all_reduce(total)
    dist.destroy_process_group()
    return total.item()

print("returned", all_reduce_on_gpus.distributed())""",
    "print('kernel tensor still usable:', float(held.sum()))",
]


@needs_gpus(2)
def test_a_kernel_that_initialised_cuda_launches_on_the_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CUDA_FIRST_CELLS])
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert stream_text(notebook.cells[0]) == "kernel CUDA context: cuda:0\n"
    assert "returned [3.0, 3.0]" in stream_text(notebook.cells[1])
    assert stream_text(notebook.cells[2]) == f"kernel tensor still usable: {1024.0 * 1024.0}\n"


FAILING_CELLS = [
    """from fanrun import distributed

def check(batch):
    if batch < 0:
        raise ValueError(f"bad batch {batch}")

@distributed(num_accelerators=2, tracking=False)
def train():
    import os, time
    print("training", flush=True)
    open(f"printed-{os.environ['RANK']}", "w").close()
    while not os.path.exists("printed-0"):  # rank 1 fails only once rank 0 has printed too
        time.sleep(0.01)
    check(-int(os.environ["RANK"]))
    time.sleep(60)

train.distributed()""",
    """@distributed(num_accelerators=2, timeout=6, tracking=False)
def hang():
    import time
    time.sleep(60)

hang.distributed()""",
]


def test_a_failure_in_a_cell_shows_the_rank_traceback_once_without_fanrun_frames(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in FAILING_CELLS])
    NotebookClient(notebook, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    failing, hanging = notebook.cells

    (error,) = [o for o in failing.outputs if o.output_type == "error"]
    assert error.ename == "ValueError" and "[rank 1] bad batch -1" in error.evalue
    shown = "\n".join(error.traceback)
    # The rank's traceback once, with the cell's source lines, and only the user's frames.
    assert shown.count("bad batch -1") == 2, shown  # in the rank's traceback, and in the raised error
    assert 'raise ValueError(f"bad batch {batch}")' in shown and "check(-int(os.environ" in shown
    assert shown.count('raise ValueError(f"bad batch {batch}")') == 1
    # None of fanrun's frames: the error is raised from the cell's own line.
    for fanrun_frame in ("_launch/", "_rank/", "_tracking", "backends/", "runpy"):
        assert fanrun_frame not in shown, fanrun_frame
    assert "site-packages/fanrun/" not in shown, shown
    assert "[rank0]: training" in stream_text(failing)
    assert "Traceback" not in stream_text(failing, "stderr")  # not printed live as well

    (timeout,) = [o for o in hanging.outputs if o.output_type == "error"]
    assert timeout.ename == "RunTimeoutError"
    stacks = "\n".join(timeout.traceback)
    assert "in hang" in stacks and "time.sleep(60)" not in stream_text(hanging, "stderr")
    assert "Current thread" not in stream_text(hanging, "stderr")  # the stacks once, in the error


DETACHING_CELL = """import os
from fanrun import distributed

@distributed(num_accelerators=2, detach=True, tracking=False)
def train(gate):
    import os, time
    print(f"rank {os.environ['RANK']} waits", flush=True)
    while not os.path.exists(gate):
        time.sleep(0.02)
    print(f"rank {os.environ['RANK']} trained", flush=True)
    return int(os.environ["RANK"]) * 10

run = train.distributed(GATE)
print(run.id, os.getpid())"""

ATTACHING_CELL = """import pathlib
import fanrun
pathlib.Path(GATE).touch()
run = fanrun.attach(RUN_ID)
print("result", run.result(), run.status)"""


def test_a_detached_run_started_in_a_kernel_is_attached_from_the_restarted_kernel(tmp_path):
    gate = tmp_path / "gate"
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(DETACHING_CELL.replace("GATE", repr(str(gate))))])
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})

    async def scenario() -> tuple[str, int]:
        async with client.async_setup_kernel():
            await client.async_execute_cell(notebook.cells[0], 0)
            run_id, kernel_pid = stream_text(notebook.cells[0]).split()
            await client.km.restart_kernel(now=True)
            await client.kc.wait_for_ready(timeout=60)
            assert wait_gone([int(kernel_pid)], timeout=10) == []  # the kernel that started the run is gone
            notebook.cells.append(nbformat.v4.new_code_cell(
                ATTACHING_CELL.replace("GATE", repr(str(gate))).replace("RUN_ID", repr(run_id))))
            await client.async_execute_cell(notebook.cells[1], 1)
            return run_id, int(kernel_pid)

    run_id, _ = asyncio.run(scenario())
    shown = stream_text(notebook.cells[1])
    for rank in (0, 1):
        # Its whole output, from the lines printed before the restart on.
        assert shown.index(f"[rank{rank}]: rank {rank} waits") < shown.index(f"[rank{rank}]: rank {rank} trained")
    assert shown.endswith("result [0, 10] FINISHED\n"), shown
    runner = records.RunRecord.find(run_id).read_runner()["pid"]
    assert wait_gone([runner], timeout=10) == []
