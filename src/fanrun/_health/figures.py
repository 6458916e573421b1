"""What each GPU model should reach, for the deep check: dense bf16 matrix products (TFLOP/s, the
datasheet's figure without sparsity) and memory bandwidth (HBM or GDDR, TB/s)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Expected:
    bf16_tflops: float
    memory_tbps: float


# Looked up by the words of NVML's name, most specific first ("NVIDIA H100 80GB HBM3" is an SXM
# part; "NVIDIA H100 PCIe" is not).
_MODELS: tuple[tuple[tuple[str, ...], Expected], ...] = (
    (("H200",), Expected(989.0, 4.8)),
    (("H100", "PCIE"), Expected(756.0, 2.0)),
    (("H100",), Expected(989.0, 3.35)),
    (("A100", "80GB"), Expected(312.0, 2.0)),
    (("A100",), Expected(312.0, 1.55)),
    (("L4",), Expected(121.0, 0.3)),
    (("A10",), Expected(125.0, 0.6)),
)

# Below this share of its model's figure, or of the median of its node's peers, a GPU is slow.
SLOW_FRACTION = 0.5


def expected(name: str) -> Expected | None:
    """The figures of the GPU NVML calls `name`, or None for a model this table does not know."""
    words = set(name.upper().replace("-", " ").split())
    for needed, figures in _MODELS:
        if all(word in words for word in needed):
            return figures
    return None

# NCCL's all-reduce bus bandwidth (GB/s) over a node's NVLink, where fanrun knows it: half of
# NVLink's bidirectional figure. Nodes of other GPUs are measured, not judged.
_ALL_REDUCE_GBPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 450.0),
    (("H100", "PCIE"), 0.0),
    (("H100",), 450.0),
    (("A100", "SXM4"), 300.0),
)


def expected_all_reduce_gbps(name: str) -> float | None:
    words = set(name.upper().replace("-", " ").split())
    for needed, figure in _ALL_REDUCE_GBPS:
        if all(word in words for word in needed):
            return figure or None
    return None
