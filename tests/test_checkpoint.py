"""VolumeWriter / VolumeReader with DDP on 2 CPU ranks (gloo): save, async_save while training
goes on, overwrite, keep_last, fsspec URLs; and, in this process, latest_checkpoint's choice."""

from __future__ import annotations

import json
import os

import pytest

from checkpoint_helpers import load_here, make_model, save_here
from fanrun import distributed


@distributed(num_accelerators=2)
def ddp_checkpoints(root: str, url_root: str, local_staging: str):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkpoint_helpers import make_model
    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(make_model(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))

    def train_step():
        loss = model(data).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def state(step):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": step, "note": f"saved at step {step}"}

    def weights():
        return [p.detach().clone() for p in model.module.parameters()]

    def load(path, **reader_options):
        fresh = DDP(make_model(seed=123))
        fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
        loaded = {"model": model_sd, "optim": optim_sd, "step": -1, "note": ""}
        dcp.load(loaded, storage_reader=VolumeReader(path, **reader_options))
        set_state_dict(fresh, fresh_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        momentum = [fresh_optimizer.state[p]["momentum_buffer"].clone() for p in fresh.module.parameters()]
        return [p.detach().clone() for p in fresh.module.parameters()], momentum, loaded["step"], loaded["note"]

    out = {"rank": rank}
    train_step()
    dcp.save(state(1), storage_writer=VolumeWriter(f"{root}/step_1", keep_last=2))
    out["saved1"] = weights()

    train_step()
    out["saved2"] = weights()
    out["momentum2"] = [optimizer.state[p]["momentum_buffer"].clone() for p in model.module.parameters()]
    future = dcp.async_save(state(2), storage_writer=VolumeWriter(f"{root}/step_2", keep_last=2))
    # Training goes on at once: the staged copy, not these changes, must reach the checkpoint.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    future.result()
    out["latest_after_2"] = latest_checkpoint(root)

    # A second async save stages into the host buffers the first one wrote from: it must hold
    # the values of its own call, not the first one's, nor the changes made after it.
    from fanrun.data.checkpoint.staging import _HOST_BUFFERS

    out["buffers_kept"] = sum(len(kept) for kept in _HOST_BUFFERS._free.values())
    out["saved2_again"] = weights()
    future = dcp.async_save(state(2), storage_writer=VolumeWriter(f"{root}-again/step_2"))
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(100.0)
    future.result()
    out["loaded2_again"] = load(f"{root}-again/step_2")

    train_step()
    dcp.save(state(3), storage_writer=VolumeWriter(f"{root}/step_3", keep_last=2))
    # Overwriting: the same path again, with other values.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    out["saved3"] = weights()
    dcp.save(state(3), storage_writer=VolumeWriter(f"{root}/step_3", keep_last=2))

    out["loaded2"] = load(f"{root}/step_2")
    out["loaded3"] = load(latest_checkpoint(root))

    # An fsspec URL: staged on local disk, uploaded, overwritten in place.
    dcp.save(state(4), storage_writer=VolumeWriter(f"{url_root}/step_4", local_staging_dir=local_staging))
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)
    out["saved4"] = weights()
    dcp.save(state(4), storage_writer=VolumeWriter(f"{url_root}/step_4", local_staging_dir=local_staging))
    out["latest_url"] = latest_checkpoint(url_root)
    out["loaded4"] = load(out["latest_url"], local_staging_dir=local_staging)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp") / "checkpoints"
    url_dir = tmp_path_factory.mktemp("url")
    url_root = f"file://{url_dir}/checkpoints"
    local_staging = tmp_path_factory.mktemp("local-staging")
    results = ddp_checkpoints.distributed(str(root), url_root, str(local_staging))
    assert os.listdir(local_staging) == []  # uploads and downloads staged there are removed
    return root, url_dir / "checkpoints", url_root, results


def assert_equal_lists(a, b):
    import torch

    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_save_and_load_round_trip_on_every_rank(ddp_run):
    _, _, _, results = ddp_run
    for out in results:
        weights, momentum, step, note = out["loaded3"]
        assert_equal_lists(weights, results[0]["saved3"])
        assert step == 3 and note == "saved at step 3"  # pickled objects come back too


def test_async_save_keeps_the_state_of_the_call_and_completes(ddp_run):
    import torch

    _, _, _, results = ddp_run
    for out in results:
        weights, momentum, step, _ = out["loaded2"]
        assert_equal_lists(weights, results[0]["saved2"])  # not the +100 made after the call
        assert_equal_lists(momentum, out["momentum2"])
        assert step == 2
        assert out["latest_after_2"].endswith("step_2")
        assert out["buffers_kept"] > 0  # the second save reused the first one's host buffers
        again, _, _, _ = out["loaded2_again"]
        assert_equal_lists(again, results[0]["saved2_again"])
        assert not all(torch.equal(x, y) for x, y in zip(again, results[0]["saved2"]))


def test_overwrite_keep_last_and_no_leftovers(ddp_run):
    root, _, _, results = ddp_run
    # step_1 pruned by keep_last=2; the replaced step_3 and every partial directory removed.
    assert sorted(os.listdir(root)) == ["step_2", "step_3"]
    files = sorted(os.listdir(root / "step_3"))
    record = json.loads((root / "step_3" / "fanrun-checkpoint.json").read_text())
    assert files == sorted(["fanrun-checkpoint.json", record["metadata"], *record["files"]])
    assert sorted(record["files"]) == [f"r0-{record['save_id']}.data", f"r1-{record['save_id']}.data"]
    assert record["world_size"] == 2


def test_fsspec_url_is_staged_uploaded_and_overwritten(ddp_run):
    _, url_dir, url_root, results = ddp_run
    for out in results:
        assert out["latest_url"] == f"{url_root}/step_4"
        assert_equal_lists(out["loaded4"][0], results[0]["saved4"])
    record = json.loads((url_dir / "step_4" / "fanrun-checkpoint.json").read_text())
    # Only the second save's files remain: the first one's were removed after its record was replaced.
    assert sorted(os.listdir(url_dir / "step_4")) == sorted(
        ["fanrun-checkpoint.json", record["metadata"], *record["files"]]
    )


def test_memory_url_in_one_process():
    import torch

    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    model = make_model(seed=5)
    save_here({"model": model.state_dict()}, VolumeWriter("memory://fanrun-test/ckpt/a"))
    assert latest_checkpoint("memory://fanrun-test/ckpt") == "memory://fanrun-test/ckpt/a"
    other = make_model(seed=6)
    state = {"model": other.state_dict()}
    load_here(state, VolumeReader("memory://fanrun-test/ckpt/a"))
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)


def test_items_written_and_read_in_many_batches_load_back(tmp_path, monkeypatch):
    import torch

    from fanrun.data import VolumeReader, VolumeWriter
    from fanrun.data.checkpoint import engine_io

    # Items are written and read in batches (GPU tensors pass through pinned memory a batch at a
    # time, host ones in larger batches); tiny batches here make nearly every item its own.
    monkeypatch.setattr(engine_io, "BATCH_BYTES", 1000)
    monkeypatch.setattr(engine_io, "HOST_BATCH_FACTOR", 1)
    model = make_model(seed=3)
    state = {"model": model.state_dict(), "strided": torch.arange(60.0).reshape(6, 10).t(), "meta": {"a": 1}}
    save_here(state, VolumeWriter(tmp_path / "ckpt", thread_count=3, chunk_bytes=4096))
    other = make_model(seed=4)
    loaded = {"model": other.state_dict(), "strided": torch.zeros(10, 6), "meta": {"a": 0}}
    load_here(loaded, VolumeReader(tmp_path / "ckpt", thread_count=2, chunk_bytes=512))
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(loaded["strided"], state["strided"]) and loaded["meta"] == {"a": 1}


def test_a_batch_that_fails_to_stage_while_the_one_before_is_written_fails_the_save_cleanly(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import VolumeWriter
    from fanrun.data.checkpoint import engine_io, writer

    # The next batch is staged while the engine writes the one before: a failure there must
    # wait for that write (which reads the staged memory) and leave no checkpoint behind.
    monkeypatch.setattr(engine_io, "BATCH_BYTES", 1000)
    monkeypatch.setattr(engine_io, "HOST_BATCH_FACTOR", 1)
    staged = []
    real_to_host = writer._to_host

    def to_host_failing_third(batch):
        staged.append(batch)
        if len(staged) == 3:
            raise MemoryError("no pinned memory left for batch 3")
        return real_to_host(batch)

    monkeypatch.setattr(writer, "_to_host", to_host_failing_third)
    with pytest.raises(CheckpointException, match="no pinned memory left for batch 3"):
        save_here({"model": make_model(seed=5).state_dict()}, VolumeWriter(tmp_path / "ckpt"))
    assert len(staged) == 3 and not (tmp_path / "ckpt").exists()
    partial = [name for name in os.listdir(tmp_path) if not name.endswith(".lock")]
    assert len(partial) == 1 and os.listdir(tmp_path / partial[0]) == []  # the data file is removed
    # The next save clears what the failed one left and publishes.
    monkeypatch.setattr(writer, "_to_host", real_to_host)
    save_here({"model": make_model(seed=5).state_dict()}, VolumeWriter(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_overwriting_never_leaves_the_path_without_a_complete_checkpoint(tmp_path):
    import threading

    from fanrun.data import VolumeWriter
    from fanrun.data.checkpoint.storage import read_record

    path = tmp_path / "step"
    state = {"model": make_model(seed=8).state_dict()}
    save_here(state, VolumeWriter(path))
    done = threading.Event()
    errors = []

    def overwrite_repeatedly():
        try:
            for _ in range(15):
                save_here(state, VolumeWriter(path))
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)
        finally:
            done.set()

    writer = threading.Thread(target=overwrite_repeatedly)
    writer.start()
    seen = set()
    # Checked as fast as this thread can, while the other one replaces the checkpoint 15 times.
    while not done.is_set():
        seen.add(read_record(str(path))["save_id"])
    writer.join()
    assert not errors, errors
    assert len(seen) > 1  # the checks did overlap the replacements
    assert [n for n in os.listdir(tmp_path)] == ["step"]


def test_an_empty_state_dict_is_a_checkpoint_too(tmp_path):
    from fanrun.data import VolumeReader, VolumeWriter, latest_checkpoint

    save_here({}, VolumeWriter(tmp_path / "empty"))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "empty")
    load_here({}, VolumeReader(tmp_path / "empty"))


def test_latest_checkpoint_ignores_what_is_not_complete(tmp_path):
    from fanrun.data import VolumeWriter, latest_checkpoint
    from fanrun.data.checkpoint.layout import RECORD_NAME

    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None
    model = make_model(seed=1)
    save_here({"model": model.state_dict()}, VolumeWriter(tmp_path / "b"))
    save_here({"model": model.state_dict()}, VolumeWriter(tmp_path / "a"))  # newer, though it sorts first
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a")
    # Things latest_checkpoint must pass over: a directory of something else, a hidden partial
    # save, and a checkpoint whose data file lost its end.
    (tmp_path / "z_not_a_checkpoint").mkdir()
    (tmp_path / "z_not_a_checkpoint" / ".metadata").write_bytes(b"DCP's own format")
    (tmp_path / ".c.fanrun-partial-1234").mkdir()
    record = json.loads((tmp_path / "a" / RECORD_NAME).read_text())
    data = tmp_path / "a" / next(iter(record["files"]))
    os.truncate(data, data.stat().st_size - 1)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "b")


def test_partial_save_of_a_live_process_is_not_a_leftover(tmp_path):
    import threading

    from fanrun.data.checkpoint.layout import partial_dir
    from fanrun.data.checkpoint.storage import SaveLock, clean_leftovers

    # An async save still writing in this process (its own thread) or in another holds its
    # partial directory's lock: a new save in the same root must leave it alone, and clean it
    # once the save is over (its thread has ended).
    partial = partial_dir(str(tmp_path / "step_9"), "inflight")
    taken, done = threading.Event(), threading.Event()

    def async_save():
        SaveLock(partial)
        taken.set()
        done.wait()

    saving = threading.Thread(target=async_save)
    saving.start()
    taken.wait()
    os.mkdir(partial)
    assert clean_leftovers(str(tmp_path)) == []
    assert os.path.isdir(partial)
    # A crashed save's lock file is still there, but no process holds the lock any more.
    abandoned = partial_dir(str(tmp_path / "step_8"), "dead")
    os.mkdir(abandoned)
    with open(abandoned + ".lock", "w"):
        pass
    assert clean_leftovers(str(tmp_path)) == [abandoned]
    done.set()
    saving.join()
    assert clean_leftovers(str(tmp_path)) == [partial]
    assert os.listdir(tmp_path) == []


def test_a_lock_released_by_the_garbage_collector_during_another_release_does_not_deadlock(tmp_path):
    import subprocess
    import sys

    # A writer that no one references any more is collected in whatever thread allocates next,
    # and its finalizer releases its save lock there: possibly inside another lock's release.
    # The collector is made to run at one such point.
    code = f"""
import gc, os, weakref
from fanrun.data.checkpoint.storage import SaveLock

class Writer:
    pass

releasing = SaveLock({str(tmp_path / "a")!r})
collected = Writer()
collected.cycle = collected
weakref.finalize(collected, SaveLock({str(tmp_path / "b")!r}).release)
del collected
unlink = os.unlink

def unlink_then_collect(path):
    unlink(path)
    gc.collect()

os.unlink = unlink_then_collect
releasing.release()
print("released")
"""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("releasing a save lock deadlocked with a finalizer releasing another")
    assert done.stdout == "released\n", done.stderr
    assert os.listdir(tmp_path) == []


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from fanrun.data import NotACheckpointError, VolumeReader, VolumeWriter

    with pytest.raises(ValueError, match="thread_count"):
        VolumeWriter(tmp_path / "x", thread_count=0)
    with pytest.raises(ValueError, match="keep_last"):
        VolumeWriter(tmp_path / "x", keep_last=0)
    with pytest.raises(NotACheckpointError, match="has no fanrun-checkpoint.json"):
        VolumeReader(tmp_path)
    state = {"model": make_model(seed=2).state_dict()}
    # A directory of someone else's files is never replaced.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointException, match="not a complete fanrun checkpoint"):
        save_here(state, VolumeWriter(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    save_here(state, VolumeWriter(tmp_path / "ckpt"))
    with pytest.raises(CheckpointException, match="overwrite=False"):
        save_here(state, VolumeWriter(tmp_path / "ckpt", overwrite=False))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "mine"]  # no partial directory left
