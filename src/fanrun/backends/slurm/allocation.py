"""Slurm from the caller's side: whether this process runs inside an allocation, the slurm=
options, and the srun command that starts one fanrun agent per node.

Inside an allocation (salloc, sbatch: SLURM_JOB_ID is set), srun runs a step of it. Outside one,
on a login node, srun asks Slurm for an allocation with the slurm= options, holds it for the
step, and gives it back when the step ends."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping

from ..._errors import NodeEnvironmentError

# srun's options that slurm= may pass, by their long names with '_' for '-'.
OPTIONS = ("partition", "time", "account", "qos", "reservation", "gres", "gpus_per_node", "constraint", "mem",
           "mem_per_cpu", "cpus_per_task", "exclusive", "nodelist", "exclude", "job_name", "comment")
# Options fanrun sets itself, for one agent per node.
OWN = ("nodes", "ntasks", "ntasks_per_node", "input", "kill_on_bad_exit")


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def check_options(slurm: object) -> dict[str, str]:
    """slurm= as srun's options: {'partition': 'gpu', 'time': '01:00:00', 'exclusive': True}."""
    if slurm is None:
        return {}
    if not isinstance(slurm, Mapping):
        raise TypeError(f"slurm must be a dict of srun's options ({{'partition': 'gpu', 'time': '1:00:00'}}), "
                        f"not {type(slurm).__name__}")
    out = {}
    for key, value in slurm.items():
        name = str(key).replace("-", "_")
        if name in OWN:
            raise ValueError(f"slurm={{{key!r}: ...}}: fanrun sets --{name.replace('_', '-')} itself "
                             f"(one agent per node); give nodes= instead")
        if name not in OPTIONS:
            raise ValueError(f"slurm={{{key!r}: ...}} is not one of the srun options fanrun passes on: "
                             f"{', '.join(OPTIONS)}")
        if value is False or value is None:
            continue
        if isinstance(value, bool):
            out[name] = ""
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            text = str(value)
            if not text or "\n" in text:
                raise ValueError(f"slurm={{{key!r}: {value!r}}}: a value must be one line of text")
            out[name] = text
        else:
            raise TypeError(f"slurm={{{key!r}: ...}} must be a string, a number or True, not {type(value).__name__}")
    return out


def check_reachable() -> None:
    """srun is on PATH, to start the agents."""
    if shutil.which("srun") is None:
        raise NodeEnvironmentError("backend='slurm' needs Slurm's srun on PATH, and there is none: run on a login node or "
                         "inside an allocation (salloc, sbatch) of a Slurm cluster")


def gpus_per_node(options: Mapping[str, str]) -> int:
    """The GPUs each node gives the call: the allocation's (SLURM_GPUS_ON_NODE), or gres=gpu:N or
    gpus_per_node=N of slurm=."""
    for text in (options.get("gpus_per_node"), _gres_gpus(options.get("gres", ""))):
        if text:
            return int(text.rsplit(":", 1)[-1])
    if in_allocation() and os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(os.environ["SLURM_GPUS_ON_NODE"])
    return 0


def _gres_gpus(gres: str) -> str | None:
    match = re.search(r"(?:^|,)gpu(?::[\w.-]+)?:(\d+)", gres)
    return match.group(1) if match else None


def srun_command(nodes: int, options: Mapping[str, str], agent: list[str]) -> list[str]:
    """srun with one task per node, every task given the caller's stdin, and a task that fails
    ending the step; under setpriv, so that srun (and with it the step) ends with the caller."""
    argv = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--input=all", "--job-name=" + options.get("job_name", "fanrun")]
    for name, value in options.items():
        if name != "job_name":
            flag = "--" + name.replace("_", "-")
            argv.append(flag if value == "" else f"{flag}={value}")
    if shutil.which("setpriv") is not None:
        argv = ["setpriv", "--pdeathsig", "TERM", *argv]
    return argv + agent
