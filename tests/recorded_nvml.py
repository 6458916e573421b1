"""The GPU health gate's fault-injection seam for the tests: recorded_nvml.c, a stand-in
libnvidia-ml.so built from its one C file (never part of the wheel), and the answers it gives."""

from __future__ import annotations

import subprocess
from pathlib import Path

SEAM = Path(__file__).resolve().parents[1] / "cpp" / "src" / "accelerators" / "recorded_nvml.c"
GIB = 1 << 30


def build(folder: Path) -> Path:
    library = folder / "librecorded_nvml.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(library), str(SEAM)], check=True)
    return library


def gpu_answers(index: int, **changes: str) -> str:
    """One healthy H200's answers, with `changes` (an answer's name -> its recorded text, "" to leave it out)."""
    answers = {"name": "NVIDIA H200", "uuid": uuid(index), "memory": f"{141 * GIB} {GIB // 2}", "ecc_uncorrected": "0",
               "retired_pages_pending": "0", "remapped_rows": "0 0 0 0", "throttle_reasons": "0x1",
               "pcie": "1 5 16 16", "utilization": "0", **changes}
    return f"gpu {index}\n" + "".join(f"{key} {value}\n" for key, value in answers.items() if value and key != "process") + \
        "".join(f"process {line}\n" for line in changes.get("process", "").split(";") if line)


def node_answers(*gpus: str) -> str:
    """A node's answers: its driver, then one text per GPU."""
    return "driver 550.54.15\n" + "".join(gpus)


def uuid(index: int) -> str:
    return f"GPU-{index:08d}-0000-0000-0000-000000000000"
