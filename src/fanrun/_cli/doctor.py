"""`fanrun doctor [--deep]`: the GPU health gate on every GPU of this node, as a table; the exit
status is 1 where a GPU is unhealthy."""

from __future__ import annotations

import argparse
import json
import sys

from .._errors import GpuHealthError

_THROTTLE_MASK = 0xE8  # the bits the gate judges (_health/gate.py THROTTLE_TROUBLE)


def add_parser(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser(
        "doctor", help="check the health of this node's GPUs",
        description="Runs the check that every GPU call passes before its ranks start, on every GPU this process "
        "sees (CUDA_VISIBLE_DEVICES narrows them): uncorrectable ECC errors, memory pages or rows awaiting "
        "retirement, clocks throttled by heat or power, a PCIe link narrower than its maximum (or of a lower "
        "generation while the GPU is busy), and other processes holding memory. --deep adds a few seconds of bf16 "
        "matrix products, a memory copy and an all-reduce on the GPUs, judged against their model's figures. "
        "Exits 1 when a GPU is unhealthy, 2 when the check cannot run.")
    doctor.add_argument("--deep", action="store_true", help="also measure every GPU (about 10 s)")
    doctor.add_argument("--json", action="store_true", help="print the readings and verdicts as JSON")


def main(options: argparse.Namespace) -> int:
    from .._launch import call
    from .._spec.program import RankProgram
    from .._spec.spec import Options

    level = "deep" if options.deep else "cheap"
    asked = Options(num_accelerators=None, accelerator=None, timeout=None, tracking=False, display="quiet",
                    health=level)
    spec = call.plan("fanrun-doctor", asked, RankProgram.function())
    if not spec.gpus():
        print(f"fanrun doctor: {spec.inventory.describe()}: there is no GPU to check here"
              + ("; the deep checks run CUDA work on GPUs" if options.deep else ""), file=sys.stderr)
        return 2 if options.deep else 0
    try:
        gate = call.check_health(spec)
    except GpuHealthError as error:
        print(f"fanrun doctor: {error}", file=sys.stderr)
        return 2
    if options.json:
        print(json.dumps({"health": level, "notes": gate.notes, "gpus": [
            {"nvml_index": gpu.nvml_index, "uuid": gpu.uuid, "name": gpu.name,
             "reading": gate.readings.get(gpu.nvml_index), "figures": gate.figures.get(gpu.nvml_index, {}),
             "problems": gate.problems[gpu.nvml_index]} for gpu in gate.gpus]}, indent=2))
    else:
        _print_table(gate, options.deep)
    return 1 if any(gate.problems.values()) else 0


def _print_table(gate, deep: bool) -> None:
    header = ["GPU", "UUID", "NAME", "ECC", "MEMORY-REPAIR", "THROTTLE", "PCIE", "OTHER-PROCS"]
    if deep:
        header += ["BF16-TFLOP/S", "COPY-TB/S", "ALLREDUCE-GB/S"]
    rows = [header + ["VERDICT"]]
    for gpu in gate.gpus:
        reading = gate.readings.get(gpu.nvml_index) or {}
        row = [str(gpu.nvml_index), gpu.uuid, gpu.name.replace(" ", "_"), _text(reading.get("ecc_uncorrected_volatile")),
               _repair(reading), _throttle(reading.get("throttle_reasons")), _pcie(reading),
               _text(None if reading.get("compute_processes") is None else len(reading["compute_processes"]))]
        if deep:
            figures = gate.figures.get(gpu.nvml_index, {})
            row += [_figure(figures.get(key)) for key in ("bf16_tflops", "copy_tbps", "all_reduce_bus_gbps")]
        rows.append(row + ["unhealthy" if gate.problems[gpu.nvml_index] else "healthy"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) + 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for gpu in gate.gpus:
        for problem in gate.problems[gpu.nvml_index]:
            print(f"GPU {gpu.nvml_index}: {problem}")
    for note in gate.notes:
        print(f"note: {note}")


def _text(value) -> str:
    return "n/a" if value is None else str(value)  # n/a: NVML does not support it on this GPU


def _figure(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _repair(reading: dict) -> str:
    flags = [name for key, name in (("retired_pages_pending", "pages-pending"), ("remapped_rows_pending", "rows-pending"),
                                    ("remapped_rows_failure", "remap-failed")) if reading.get(key)]
    known = any(reading.get(key) is not None for key in ("retired_pages_pending", "remapped_rows_pending"))
    return ",".join(flags) if flags else ("none" if known else "n/a")


def _throttle(reasons) -> str:
    if reasons is None:
        return "n/a"
    return f"0x{reasons:x}" + ("!" if reasons & _THROTTLE_MASK else "")


def _pcie(reading: dict) -> str:
    keys = ("pcie_generation", "pcie_generation_max", "pcie_width", "pcie_width_max")
    if any(reading.get(key) is None for key in keys):
        return "n/a"
    generation, generation_max, width, width_max = (reading[key] for key in keys)
    return f"gen{generation}/{generation_max},x{width}/x{width_max}"
