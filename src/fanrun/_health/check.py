"""The health gate as the call path holds it (_launch/call.py): once the GPUs' locks are held and
before any rank starts, every GPU of the call is judged (cheap: NVML; deep: and a short call of
work on each), then the call goes on, on its healthy GPUs re-ranked with exclude_unhealthy=True, or
stops with a GpuHealthError naming each unhealthy GPU."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable

from .._errors import GpuHealthError
from .._spec.spec import CallSpec
from ..backends.local import spares
from . import deep, gate, reader

# MLflow keeps a parameter's value to this many characters (older servers: 500).
_PARAM_CHARS = 500


class Gate:
    """The verdict on one call's GPUs: `problems` by NVML index (empty: healthy), `figures` of the
    deep check by NVML index, and `notes` (what was not checked, and why)."""

    def __init__(self, spec: CallSpec, own_ranks: Iterable[int] = ()) -> None:
        self.spec = spec
        self.gpus = spec.gpus()
        self.level = spec.options.health if self.gpus else "off"
        self.problems: dict[int, list[str]] = {gpu.nvml_index: [] for gpu in self.gpus}
        self.figures: dict[int, dict[str, float]] = {}
        self.notes: list[str] = []
        self.readings: dict[int, dict | None] = {}
        if self.level == "off":
            return
        readings, why = reader.read([gpu.nvml_index for gpu in self.gpus])
        if why:
            raise GpuHealthError(f"the GPU health check could not read NVML ({why}), so no GPU of this call was "
                                 f"checked and no rank was started; pass health='off' (fanrun run --health off) to "
                                 f"run without the check")
        # This caller's own processes may hold memory on its GPUs: itself (a notebook that used
        # CUDA), the ranks it keeps alive between calls (keep_alive), and `own_ranks`: the ranks a
        # failed attempt kept in their processes for this one, with their CUDA context.
        own = {os.getpid(), *spares.kept_pids(), *own_ranks}
        for gpu, reading in zip(self.gpus, readings):
            self.readings[gpu.nvml_index] = reading
            self.problems[gpu.nvml_index] = gate.problems(reading, gpu.uuid, own)

    def healthy(self) -> tuple:
        return tuple(gpu for gpu in self.gpus if not self.problems[gpu.nvml_index])

    def run_deep(self, run_call: Callable[[CallSpec], list]) -> None:
        """With health="deep": the work call on the GPUs the cheap check passed, through `run_call`
        (the call path's, with these GPUs' locks held already), and its figures judged."""
        healthy = self.healthy()
        if self.level != "deep" or not healthy:
            return
        try:
            results = run_call(deep.work_call(self.spec, healthy))
        except Exception as error:  # a rank's, in its own type; an interrupt is not caught
            first_line = (str(error).splitlines() or [""])[0]
            raise GpuHealthError(f"the deep GPU health check could not run on GPUs "
                                 f"{', '.join(str(gpu.nvml_index) for gpu in healthy)} ({type(error).__name__}: "
                                 f"{first_line}); no rank of the call was started. health='cheap' checks NVML's "
                                 f"answers alone") from error
        self.figures, slow = deep.judge(healthy, results)
        for index, found in slow.items():
            self.problems[index] += found
        note = deep.one_gpu_note(healthy)
        if note:
            self.notes.append(note)

    def checked_spec(self) -> CallSpec:
        """The call to run: as planned where every GPU is healthy; on the healthy ones, re-ranked,
        with exclude_unhealthy=True (said in one line); else a GpuHealthError."""
        unhealthy = [gpu for gpu in self.gpus if self.problems[gpu.nvml_index]]
        if not unhealthy:
            return self.spec
        healthy = self.healthy()
        if not self.spec.options.exclude_unhealthy or not healthy:
            raise GpuHealthError(self._message(unhealthy, healthy),
                                 tuple((gpu.nvml_index, gpu.uuid, "; ".join(self.problems[gpu.nvml_index]))
                                       for gpu in unhealthy))
        left_out = "; ".join(f"GPU {gpu.nvml_index} ({gpu.uuid}): {self.problems[gpu.nvml_index][0]}"
                             for gpu in unhealthy)
        print(f"fanrun: {len(unhealthy)} of the call's {len(self.gpus)} GPUs left out as unhealthy ({left_out}); "
              f"it runs on GPU{'s' if len(healthy) != 1 else ''} {', '.join(str(gpu.nvml_index) for gpu in healthy)} "
              f"as {'rank 0' if len(healthy) == 1 else f'ranks 0-{len(healthy) - 1}'}", file=sys.stderr, flush=True)
        spec, inventory = self.spec, self.spec.inventory
        # The description names the GPUs: ranks kept alive for a call on other GPUs (keep_alive, whose
        # kept ranks must match the plan's description) are not taken for this one.
        indices = ", ".join(str(gpu.nvml_index) for gpu in healthy)
        plan = dataclasses.replace(spec.plan, world_size=len(healthy),
                                   description=f"{inventory.describe(healthy)} (GPU{'s' if len(healthy) != 1 else ''} "
                                               f"{indices})",
                                   accelerator_type=f"GPU_{len(healthy)}x{healthy[0].model}")
        # The ranks see the healthy GPUs alone, in rank order: LOCAL_RANK N is the Nth of them.
        env = {**spec.env, "CUDA_VISIBLE_DEVICES": ",".join(gpu.uuid for gpu in healthy)}
        return dataclasses.replace(spec, plan=plan, inventory=dataclasses.replace(inventory, visible=healthy), env=env)

    def _message(self, unhealthy: list, healthy: tuple) -> str:
        lines = [f"GPU {gpu.nvml_index} ({gpu.uuid}, {gpu.name}) is unhealthy: {'; '.join(self.problems[gpu.nvml_index])}"
                 for gpu in unhealthy]
        if self.spec.options.exclude_unhealthy:
            remedy = "exclude_unhealthy=True found no healthy GPU to run on"
        else:
            remedy = (f"pass exclude_unhealthy=True to run on the {len(healthy)} healthy one"
                      f"{'s' if len(healthy) != 1 else ''}" if healthy else "no GPU of the call is healthy")
        return ("\n".join(lines) + f"\nNo rank was started. {remedy}; health='off' runs without the check, and "
                f"CUDA_VISIBLE_DEVICES can leave a GPU out. `fanrun doctor` shows every GPU of this node.")

    def record(self) -> tuple[dict[str, str], dict[str, float]]:
        """What the call's MLflow run keeps: a parameter per GPU ("healthy" or why not) and the
        deep check's figures as metrics."""
        if self.level == "off":
            return {}, {}
        params = {"fanrun.health": self.level}
        for gpu in self.gpus:
            verdict = "; ".join(self.problems[gpu.nvml_index]) or "healthy"
            params[f"fanrun.health.gpu_{gpu.nvml_index}"] = verdict[:_PARAM_CHARS]
        metrics = {f"fanrun.health.gpu_{index}.{key}": value
                   for index, figures in self.figures.items() for key, value in figures.items()}
        return params, metrics


def node_record(level: str, verdicts: dict[int, list[dict]]) -> dict[str, str]:
    """What the call's MLflow run keeps of the gate each node of a cluster ran on its own GPUs
    (_health/node.py's verdicts, by node): a parameter per node's GPU, as record() keeps one per GPU."""
    params = {"fanrun.health": level}
    for node, gpus in sorted(verdicts.items()):
        for gpu in gpus:
            where = f"node_{node}.gpu_{gpu['index']}" if gpu["index"] is not None else f"node_{node}"
            params[f"fanrun.health.{where}"] = ("; ".join(gpu["problems"]) or "healthy")[:_PARAM_CHARS]
    return params
