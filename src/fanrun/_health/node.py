"""The cheap check on one node of a call over several (in a Ray or Slurm node's agent, before any
rank of the call starts on any node): the GPUs this node gives its ranks, as CUDA_VISIBLE_DEVICES
leaves them visible there, counted and judged as one machine's are (gate.py)."""

from __future__ import annotations

import os

from .. import _accelerators
from . import gate, reader


def verdicts(gpus_needed: int) -> list[dict]:
    """One entry per GPU of the node's first `gpus_needed` ({"index", "uuid", "name", "problems"},
    no problems where it is healthy), and one with index None where the node shows too few, or
    NVML cannot be read."""
    visible = _accelerators.detect().visible
    found = []
    if len(visible) < gpus_needed:
        found.append({"index": None, "uuid": "", "name": "", "problems": [
            f"the node shows {len(visible)} of the {gpus_needed} GPUs its ranks need: check `nvidia-smi` and the "
            f"kernel log there (a GPU fallen off the bus), or ask for fewer GPUs a node"]})
    used = visible[:gpus_needed]
    readings, why = reader.read([gpu.nvml_index for gpu in used])
    if why:
        return found + [{"index": None, "uuid": "", "name": "", "problems": [
            f"the GPU health check could not read NVML there ({why})"]}]
    for gpu, reading in zip(used, readings):
        found.append({"index": gpu.nvml_index, "uuid": gpu.uuid, "name": gpu.name,
                      "problems": gate.problems(reading, gpu.uuid, {os.getpid()})})
    return found
