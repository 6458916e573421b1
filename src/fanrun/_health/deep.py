"""The deep check: a short fanrun call on the GPUs the cheap check passed (work.py on each rank),
and its figures judged against the model's (figures.py) and against the node's other GPUs."""

from __future__ import annotations

import dataclasses
import statistics

from .._spec import payload as _payload
from .._spec.program import RankProgram
from .._spec.spec import CallSpec, Options
from . import figures, work

# Seconds of each measurement: with the ranks' start, CUDA's and NCCL's, about 10 s on a H200 node.
MATMUL_S, COPY_S, ALL_REDUCE_S = 2.0, 1.0, 1.0
# The check's own call ends within this, whatever happens to it.
TIMEOUT_S = 120.0

_LABELS = {"bf16_tflops": ("bf16 matrix products", "TFLOP/s"), "copy_tbps": ("a device-to-device copy", "TB/s"),
           "all_reduce_bus_gbps": ("an all-reduce over the node's GPUs", "GB/s of bus bandwidth")}


def work_call(spec: CallSpec, gpus: tuple) -> CallSpec:
    """The fanrun call that measures `gpus`, one rank each, in their order: the call's own
    machinery (ranks, rendezvous, output), untracked, quiet, and unchecked (it is the check)."""
    options = Options(num_accelerators=len(gpus), accelerator=None, timeout=TIMEOUT_S, tracking=False,
                      warm=False, display="quiet", stall_warning=None, on_stall=None, health="off")
    plan = dataclasses.replace(spec.plan, world_size=len(gpus), description=spec.inventory.describe(gpus),
                               accelerator_type=f"GPU_{len(gpus)}x{gpus[0].model}", notice="", warning="")
    return CallSpec(name="fanrun-health-deep", options=options, plan=plan, program=RankProgram.function(),
                    inventory=dataclasses.replace(spec.inventory, visible=gpus),
                    payload=_payload.serialize_call(work.measure, (MATMUL_S, COPY_S, ALL_REDUCE_S), {}),
                    env={"CUDA_VISIBLE_DEVICES": ",".join(gpu.uuid for gpu in gpus)})


def judge(gpus: tuple, results: list[dict]) -> tuple[dict[int, dict[str, float]], dict[int, list[str]]]:
    """Each GPU's figures and its problems: a figure below SLOW_FRACTION of its model's, or of the
    median of the node's GPUs, names that GPU; a slow all-reduce names every GPU it ran over."""
    measured = {gpu.nvml_index: result for gpu, result in zip(gpus, results)}
    problems: dict[int, list[str]] = {gpu.nvml_index: [] for gpu in gpus}
    fraction = figures.SLOW_FRACTION
    for key in ("bf16_tflops", "copy_tbps"):
        median = statistics.median(result[key] for result in results)
        what, unit = _LABELS[key]
        for gpu in gpus:
            value = measured[gpu.nvml_index][key]
            model = figures.expected(gpu.name)
            target = None if model is None else (model.bf16_tflops if key == "bf16_tflops" else model.memory_tbps)
            if target is not None and value < fraction * target:
                problems[gpu.nvml_index].append(
                    f"{what} reach {value:.3g} {unit}, below {fraction:.0%} of the {target:g} a {gpu.model} should: "
                    f"check its clocks and power (nvidia-smi -q -d PERFORMANCE) and what else runs on it")
            elif len(gpus) > 2 and value < fraction * median:
                problems[gpu.nvml_index].append(
                    f"{what} reach {value:.3g} {unit}, below {fraction:.0%} of the {median:.3g} that the node's "
                    f"GPUs reach (their median): check its clocks, power and cooling")
    if len(gpus) > 1:
        bus = min(result["all_reduce_bus_gbps"] for result in results)
        target = figures.expected_all_reduce_gbps(gpus[0].name)
        if target is not None and bus < fraction * target:
            for gpu in gpus:
                problems[gpu.nvml_index].append(
                    f"an all-reduce over GPUs {', '.join(str(g.nvml_index) for g in gpus)} reaches {bus:.3g} GB/s of "
                    f"bus bandwidth, below {fraction:.0%} of the {target:g} NVLink should carry: check the links "
                    f"(nvidia-smi nvlink -s, nvidia-smi topo -m) and NCCL's choice (NCCL_DEBUG=INFO)")
    return measured, problems


def one_gpu_note(gpus: tuple) -> str:
    """Why the all-reduce was not measured, where it was not."""
    return "" if len(gpus) > 1 else "the all-reduce needs two GPUs or more, and the check has one: skipped"
