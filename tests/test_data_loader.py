"""fanrun.data.DataLoader's transfer of batches from its workers: small tensors by value,
large ones through shared memory as torch sends them, and the same batches as torch's."""

from __future__ import annotations

import collections

import numpy
import torch

from fanrun.data import DataLoader
from fanrun.data._loader import SMALL_TENSOR_BYTES, _ByValue, _default_convert, _mark_small

Pair = collections.namedtuple("Pair", "left right")
SMALL = ("label", "half", "flags", "scalar", "empty", "columns")


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {
            "label": i,  # collated into an int64 tensor
            "half": torch.full((3,), i, dtype=torch.bfloat16),
            "flags": torch.tensor([i % 2 == 0, True]),
            "scalar": torch.tensor(float(i)),
            "empty": torch.empty(0, 4),
            "columns": (torch.arange(12, dtype=torch.float64).reshape(3, 4) + i).t(),  # not contiguous
            "big": torch.full((SMALL_TENSOR_BYTES // 4,), i, dtype=torch.int32),
            "pair": Pair(torch.tensor([i]), "text"),
            "name": f"sample {i}",
            "mixed": [torch.tensor([i]), f"part {i}"],  # a list holding a tensor is still looked into
        }


def test_batches_from_workers_are_torchs_with_small_tensors_sent_by_value():
    ours = list(DataLoader(Samples(), batch_size=4, num_workers=2))
    reference = list(torch.utils.data.DataLoader(Samples(), batch_size=4, num_workers=0))
    assert len(ours) == len(reference) == 3
    for got, want in zip(ours, reference):
        assert got.keys() == want.keys()
        for key in (*SMALL, "big"):
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
            assert torch.equal(got[key], want[key]), key
        assert torch.equal(got["pair"].left, want["pair"].left) and got["pair"].right == want["pair"].right
        assert got["name"] == want["name"] and got["mixed"][1] == want["mixed"][1]
        assert torch.equal(got["mixed"][0], want["mixed"][0]) and not got["mixed"][0].is_shared()
        # A tensor that came through shared memory is a shared one; one sent by value is not.
        assert [key for key in SMALL if got[key].is_shared()] == []
        assert got["big"].is_shared()


def test_a_list_of_plain_values_is_passed_whole_and_not_walked():
    """A table batch's string column: rebuilding its list value by value cost more than reading it."""
    texts = [f"row {i}" for i in range(1000)] + [None, 3, 2.5, b"x", True]
    marked = _mark_small({"text": texts, "nested": [texts, torch.ones(2)]})
    assert marked["text"] is texts
    assert marked["nested"][0] is texts and isinstance(marked["nested"][1], _ByValue)


def same_structure(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return type(got) is torch.Tensor and torch.equal(got, want)
    if isinstance(want, dict):
        return type(got) is type(want) and got.keys() == want.keys() and all(same_structure(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(same_structure, got, want))
    return type(got) is type(want) and got == want


class Batches(torch.utils.data.IterableDataset):
    """Items that are batches already (batch_size=None): converted, not collated."""

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        for i in range(worker.id, 4, worker.num_workers) if worker else range(4):
            yield {"text": [f"row {j}" for j in range(i, i + 50)] + [None, 1.5], "ids": numpy.arange(i, i + 3),
                   "nested": {"pairs": [(i, "x")], "arrays": [numpy.ones(2) * i, "y"]}}


def test_batches_given_whole_are_converted_as_torchs_with_plain_lists_copied_whole():
    texts = [f"row {i}" for i in range(100)]
    converted = _default_convert({"text": texts})
    assert converted["text"] == texts and converted["text"] is not texts  # a copy, as torch's is
    reference = [torch.utils.data.default_convert(item) for item in Batches()]
    for workers in (0, 2):
        got = list(DataLoader(Batches(), batch_size=None, num_workers=workers))
        assert same_structure(got, reference), workers
        assert type(got[0]["ids"]) is torch.Tensor and type(got[0]["nested"]["arrays"][0]) is torch.Tensor


def collate_other_kinds(samples):
    values = torch.tensor([float(s) for s in samples])
    return {
        "float8": values.to(torch.float8_e4m3fn),  # not a plain element type: as torch sends it
        "conjugate": (values * 1j + 1).conj(),  # a lazy conjugate: its bytes alone are not its values
        "negative": torch.tensor([1j, 2j]).conj().imag,  # a lazy negation, likewise
    }


def test_other_element_types_and_lazy_views_arrive_with_their_values():
    samples = list(range(8))
    ours = list(DataLoader(samples, batch_size=4, num_workers=2, collate_fn=collate_other_kinds))
    reference = [collate_other_kinds(samples[i:i + 4]) for i in (0, 4)]
    for got, want in zip(ours, reference):
        assert got["float8"].dtype == torch.float8_e4m3fn and got["float8"].is_shared()
        assert torch.equal(got["float8"].float(), want["float8"].float())
        assert torch.equal(got["conjugate"], want["conjugate"]) and torch.equal(got["negative"], want["negative"])
        assert not got["conjugate"].is_shared()
