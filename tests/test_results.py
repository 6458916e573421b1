"""Results that are large: tensors and arrays come back out of band, from a mapped file, exactly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fanrun import distributed
from fanrun._rank import result_file as _result_file


@distributed(num_accelerators=2)
def large_values():
    import os

    import numpy as np
    import torch

    rank = int(os.environ["RANK"])
    generator = torch.Generator().manual_seed(rank)
    base = torch.randn(512, 1024, generator=generator)  # 2 MiB
    complex_values = torch.randn(300_000, dtype=torch.complex64, generator=generator)
    return {
        "float32": base,
        "bfloat16": base.to(torch.bfloat16),
        "int64": torch.arange(300_000) * (rank + 1),
        "bool": base > 0,
        "transposed": base.t(),  # not contiguous
        "conj": complex_values.conj(),  # a lazy conjugate view
        "neg": torch._neg_view(base),
        "parameter": torch.nn.Parameter(base * 2),
        "numpy": np.full(600_000, rank, dtype=np.float32),
        "small": torch.arange(16) + rank,  # below the out-of-band size: inside the pickle
        "rank": rank,
    }


def expected(rank: int) -> dict:
    generator = torch.Generator().manual_seed(rank)
    base = torch.randn(512, 1024, generator=generator)
    complex_values = torch.randn(300_000, dtype=torch.complex64, generator=generator)
    return {"base": base, "complex": complex_values}


def test_large_tensors_and_arrays_come_back_exactly():
    for rank, value in enumerate(large_values.distributed()):
        want = expected(rank)
        assert value["rank"] == rank
        assert torch.equal(value["float32"], want["base"])
        assert torch.equal(value["bfloat16"], want["base"].to(torch.bfloat16))
        assert torch.equal(value["int64"], torch.arange(300_000) * (rank + 1))
        assert torch.equal(value["bool"], want["base"] > 0)
        assert torch.equal(value["transposed"], want["base"].t())
        assert torch.equal(value["conj"].resolve_conj(), want["complex"].conj().resolve_conj())
        assert not value["conj"].is_conj()
        assert torch.equal(value["neg"], -want["base"])
        assert isinstance(value["parameter"], torch.nn.Parameter) and value["parameter"].requires_grad
        assert torch.equal(value["parameter"].detach(), want["base"] * 2)
        assert isinstance(value["numpy"], np.ndarray) and (value["numpy"] == rank).all()
        assert torch.equal(value["small"], torch.arange(16) + rank)


def test_returned_tensors_are_writable_and_outlive_the_run_directory(runs_dir):
    values = large_values.distributed()
    tensor = values[1]["float32"]
    tensor += 1  # copy-on-write: the file is the caller's alone, and is already removed
    assert torch.equal(tensor, expected(1)["base"] + 1)
    assert not any(name.endswith(".result") for _, _, names in os.walk(runs_dir) for name in names)


def test_a_damaged_result_file_is_a_clear_error(tmp_path):
    import cloudpickle

    path = tmp_path / "rank_0.result"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        _result_file.write(fd, {"x": torch.ones(1 << 20)}, cloudpickle.CloudPickler)
    finally:
        os.close(fd)

    def read():
        with open(path, "rb") as file:
            return _result_file.read(file, path)

    assert torch.equal(read()["x"], torch.ones(1 << 20))
    size = path.stat().st_size
    os.truncate(path, size - 1)
    with pytest.raises(ValueError, match="is cut short"):
        read()
    path.write_bytes(b"not a result")
    with pytest.raises(ValueError, match="not one a fanrun rank wrote"):
        read()
