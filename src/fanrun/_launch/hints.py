"""Plain words for failures whose cause fanrun can tell: code written for GPUs, run on CPU processes."""

from __future__ import annotations

import re

# What torch raises when a rank without a GPU calls CUDA or asks for NCCL: a CPU build
# ("_cuda_setDevice", "not compiled with CUDA", "doesn't have NCCL built in") or a CUDA build
# on a machine without a usable GPU ("ProcessGroupNCCL is only supported with GPUs, no GPUs found!").
_GPU_ONLY = re.compile(
    r"_cuda_|not compiled with CUDA|NCCL\b|No CUDA GPUs|NVIDIA driver|CUDA-capable device|CUDA driver",
    re.IGNORECASE,
)


def note_gpu_call_on_cpu(error: BaseException, description: str) -> None:
    """Adds a note to the root cause when a CPU rank failed on a CUDA call or on NCCL."""
    if not _GPU_ONLY.search(f"{type(error).__name__}: {error}"):
        return
    error.add_note(
        f"fanrun: the ranks are {description}, with no GPU, and this failed on a CUDA call or on NCCL. "
        f'Use init_process_group("gloo") (or "cpu:gloo,cuda:nccl" to run on GPUs and CPUs alike), keep '
        f'tensors on torch.device("cpu"), and call torch.cuda.set_device() only when torch.cuda.is_available().'
    )
