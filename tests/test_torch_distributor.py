"""fanrun.TorchDistributor: Spark's TorchDistributor API, on this machine, without Spark."""

from __future__ import annotations

import pytest

from fanrun import AcceleratorMismatchError, TorchDistributor


def train(scale, offset=0):
    import os

    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]), "value": scale * 2 + offset}


def test_function_returns_rank_zeros_result():
    result = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(train, 21, offset=1)
    assert result == {"rank": 0, "world": 2, "value": 43}


def test_file_runs_on_every_rank_with_string_arguments(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nprint('file rank', os.environ['RANK'], sys.argv[1:])\n")
    assert TorchDistributor(num_processes=2, use_gpu=False).run(str(script), "--epochs", 3) is None
    out, _ = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[rank0]: file rank 0 ['--epochs', '3']", "[rank1]: file rank 1 ['--epochs', '3']"]


def test_local_mode_false_warns_that_it_runs_here():
    with pytest.warns(UserWarning, match="runs them all on this machine"):
        distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert distributor.run(train, 1)["world"] == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_processes must be at least 1"):
        TorchDistributor(num_processes=0)
    with pytest.raises(TypeError, match="num_processes must be an int"):
        TorchDistributor(num_processes="2")
    with pytest.raises(TypeError, match="use_gpu must be True or False"):
        TorchDistributor(use_gpu="yes")
    distributor = TorchDistributor(num_processes=2, use_gpu=False)
    with pytest.raises(FileNotFoundError, match="neither a function nor an existing file"):
        distributor.run("/nonexistent/train.py")
    with pytest.raises(TypeError, match="not keyword arguments"):
        distributor.run(__file__, epochs=3)
    with pytest.raises(TypeError, match="train_object must be a function"):
        distributor.run(42)


def test_use_gpu_without_a_gpu_is_a_clear_error(runs_dir):
    before = set(runs_dir.iterdir())
    with pytest.raises(AcceleratorMismatchError, match=r"use_gpu=True asks for GPUs, but this machine has no GPU.*pass use_gpu=False"):
        TorchDistributor(num_processes=2, use_gpu=True).run(train, 1)
    assert set(runs_dir.iterdir()) == before


def spark_style_train():
    """What train functions written for Spark's TorchDistributor do: rank 0 starts its own run."""
    import os

    import mlflow

    if os.environ["RANK"] != "0":
        return None
    with mlflow.start_run(run_name="mine") as run:
        mlflow.log_metric("loss", 0.5)
    return run.info.run_id


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")
def test_it_makes_no_mlflow_run_and_leaves_the_ranks_mlflow_as_configured(tmp_path, monkeypatch, capsys):
    """As Spark's TorchDistributor: no MLflow run of its own, whether tracking is on or not (no
    store is made, no line printed), and the train function's own mlflow calls go where the
    user's MLflow configuration says, as they would under Spark."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("FANRUN_TRACKING", raising=False)  # tracking on, as users have it
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # MLflow's local defaults are relative to the working directory
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))

    assert TorchDistributor(num_processes=2, use_gpu=False).run(train, 1)["world"] == 2
    assert not (tmp_path / "store.db").exists() and not (tmp_path / "data").exists()
    run_id = TorchDistributor(num_processes=2, use_gpu=False).run(spark_style_train)
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_id, r.info.run_name) for r in runs] == [(run_id, "mine")]
    assert runs[0].data.metrics == {"loss": 0.5}
    assert "MLflow run" not in capsys.readouterr().out
