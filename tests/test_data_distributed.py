"""VolumeDataset under @distributed on CPU with gloo: ranks with DataLoader workers (a
different number on each rank) read every file of a real nginx once per epoch, epochs
reshuffle, and a run killed mid-epoch resumes with another world size on exactly the rest.
Also: fanrun.data.DataLoader logs its stalled fraction to the call's MLflow run."""

from __future__ import annotations

import collections
import json
import uuid

import pytest
from nginx_server import NginxServer

from fanrun import RankFailedError, distributed, flush_tracking

pytest.importorskip("aiohttp")

NUM_FILES = 45
BATCH = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("volume")
    for i in range(NUM_FILES):
        path = root / f"dir{i % 4}" / f"sample{i:03d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"sample {i}\n" + "x" * 2000)
    server = NginxServer(root, tmp_path_factory.mktemp("nginx"))
    yield server
    server.stop()


def everything() -> set[str]:
    return {f"sample {i}" for i in range(NUM_FILES)}


@distributed(num_accelerators=2)
def read_epochs(url: str, cache_dir: str, epochs: int, loader_of: str = "fanrun"):
    import torch.distributed as dist
    import torch.utils.data

    from fanrun.data import DataLoader, VolumeDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = VolumeDataset(url, pattern="*.txt", seed=11, cache_dir=cache_dir,
                       transform=lambda path: open(path).readline().strip())
    loader_class = DataLoader if loader_of == "fanrun" else torch.utils.data.DataLoader
    loader = loader_class(ds, batch_size=4, num_workers=2 if rank == 0 else 1)
    out = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        out.append([sample for batch in loader for sample in batch])
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("loader_of", ["fanrun", "torch"])
def test_every_sample_once_per_epoch_across_ranks_and_workers_and_epochs_reshuffle(served, tmp_path, loader_of):
    """Through fanrun.data.DataLoader and through torch's own alike: the split is the dataset's."""
    per_rank = read_epochs.distributed(served.url + "/", str(tmp_path / "cache"), 2, loader_of)
    orders = []
    for epoch in range(2):
        got = [per_rank[rank][epoch] for rank in range(2)]
        assert len(got[0]) == len(got[1]) == 23  # 45 files over 2 ranks: one padded repeat
        counts = collections.Counter(got[0] + got[1])
        assert set(counts) == everything()
        assert sum(counts.values()) - NUM_FILES == 1 and max(counts.values()) == 2
        orders.append(got)
    assert orders[0] != orders[1]
    # Once per node: every file is in the cache once, and the listing was made once.
    assert len(list((tmp_path / "cache" / "files").iterdir())) == NUM_FILES
    assert len(list((tmp_path / "cache" / "listings").glob("*.json"))) == 1


def consume_then_die(url: str, cache_dir: str, out_dir: str, steps: int):
    import json
    import os
    import signal

    import torch.distributed as dist

    from fanrun.data import DataLoader, VolumeDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = VolumeDataset(url, pattern="*.txt", seed=5, cache_dir=cache_dir,
                       transform=lambda path: open(path).readline().strip())
    ds.set_epoch(1)
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    consumed = []
    for step, batch in enumerate(loader):
        consumed += batch
        if step + 1 == steps:
            break
    with open(os.path.join(out_dir, f"consumed{rank}.json"), "w") as file:
        json.dump(consumed, file)
    if rank == 0:
        with open(os.path.join(out_dir, "state.json.tmp"), "w") as file:
            json.dump(ds.state_dict(), file)
        os.replace(os.path.join(out_dir, "state.json.tmp"), os.path.join(out_dir, "state.json"))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # never passes: the run is killed


def resume(url: str, cache_dir: str, state: dict):
    import torch.distributed as dist

    from fanrun.data import DataLoader, VolumeDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = VolumeDataset(url, pattern="*.txt", seed=5, cache_dir=cache_dir,
                       transform=lambda path: open(path).readline().strip())
    ds.load_state_dict(state)
    ds.set_epoch(state["epoch"])
    loader = DataLoader(ds, batch_size=4, num_workers=[2, 1, 0][rank])
    rest = [sample for batch in loader for sample in batch]
    dist.destroy_process_group()
    return rest


def test_resume_after_a_kill_with_another_world_size_gives_exactly_the_rest(served, tmp_path):
    url, cache = served.url + "/", str(tmp_path / "cache")
    with pytest.raises(RankFailedError, match="SIGKILL"):
        distributed(num_accelerators=2)(consume_then_die).distributed(url, cache, str(tmp_path), 3)
    consumed = [json.loads((tmp_path / f"consumed{r}.json").read_text()) for r in range(2)]
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["offset"] == 2 * 3 * BATCH and state["epoch"] == 1

    rest = distributed(num_accelerators=3)(resume).distributed(url, cache, state)
    assert len({len(r) for r in rest}) == 1
    before = collections.Counter(s for r in consumed for s in r)
    after = collections.Counter(s for r in rest for s in r)
    assert max(before.values()) == 1 and not set(before) & set(after), "nothing consumed is read again"
    assert set(before) | set(after) == everything(), "nothing is skipped"
    assert sum(after.values()) - len(after) < 3  # the documented padding only


# MLflow's sqlite store uses SQLAlchemy options that SQLAlchemy 2.1 deprecates: not fanrun's to fix.
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")
def test_the_loader_logs_its_stalled_fraction_to_the_call_run(served, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("FANRUN_TRACKING", raising=False)
    for name in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # MLflow's local defaults are relative to the working directory
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    name = f"fanrun-data-{uuid.uuid4().hex[:8]}"
    client = mlflow.MlflowClient(uri)
    experiment_id = client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)

    read_epochs.distributed(served.url + "/dir0/", str(tmp_path / "cache"), 1)
    flush_tracking()  # the ranks' last values are written as the run is closed, just after the call

    (run,) = client.search_runs([experiment_id])
    for rank in range(2):
        (fraction,) = client.get_metric_history(run.info.run_id, f"data/stalled_fraction/rank_{rank}")
        (wait,) = client.get_metric_history(run.info.run_id, f"data/wait_seconds/rank_{rank}")
        assert 0.0 < fraction.value <= 1.0 and wait.value > 0.0 and fraction.step == 1
