"""The Slurm backend: a call's ranks spread over the nodes of a Slurm allocation, `world_size /
nodes` on each. `srun` starts one fanrun agent per node (agent.py), which runs its node's ranks
with the engine's own supervisor, as the Ray backend's agents do (node_agent.py); the function
and the ranks' results pass through the call's run directory, on storage every node shares.

  allocation.py  the caller's side of Slurm: in an allocation or not, the slurm= options, srun's command
  wire.py        the lines between the caller and the agents, through srun's stdin and stdout
  agent.py       `python -m fanrun.backends.slurm.agent`: one node's agent, started by srun
  ranks.py       the caller's view of every node's ranks, as the launcher drives them
"""

from __future__ import annotations

import json
import sys

from ..._accelerators import DEFAULT_CPU_RANKS, AcceleratorRequest, Plan
from ..._errors import AcceleratorMismatchError
from ..._rank import tracking as rank_tracking
from ..base import Launch
from ..node_agent import agent_spec
from . import allocation
from .ranks import SlurmRanks, start_agents

SPEC_NAME = "slurm-call.json"


def plan(num_accelerators: int | None, request: AcceleratorRequest | None, nodes: int,
         options: dict[str, str]) -> Plan:
    """The plan of a call over `nodes` Slurm nodes: `num_accelerators` ranks in all, by default
    each node's GPUs (as the allocation or gres= gives them), else DEFAULT_CPU_RANKS CPU processes
    a node. Outside an allocation, srun asks Slurm for one with `options`."""
    allocation.check_reachable()
    cpu = request is not None and request.cpu
    gpus = 0 if cpu else allocation.gpus_per_node(options)
    if request is not None and not cpu and not gpus:
        raise AcceleratorMismatchError(
            f"accelerator_type {request.text!r} asks for GPUs, but neither the allocation nor slurm={{'gres': ...}} "
            f"gives the nodes any: pass slurm={{'gres': 'gpu:N'}}, or accelerator_type='CPU'")
    per_node = (num_accelerators // nodes) if num_accelerators is not None else (gpus or DEFAULT_CPU_RANKS)
    use_gpus = gpus > 0
    unit = "GPU" if use_gpus else ("CPU process" if per_node == 1 else "CPU processes")
    noun = "node" if nodes == 1 else "nodes"
    description = f"{nodes} Slurm {noun} x {per_node} {unit}{'s' if use_gpus and per_node != 1 else ''}"
    return Plan(per_node * nodes, use_gpus, description, f"GPU_{per_node * nodes}" if use_gpus else "CPU",
                nodes=nodes, backend="slurm", slurm=tuple(sorted(options.items())))


class SlurmBackend:
    name = "slurm"

    def start(self, launch: Launch) -> SlurmRanks:
        plan = launch.plan
        per_node = plan.world_size // plan.nodes
        spec = {**agent_spec(launch), "payload": str(launch.paths.payload) if launch.expect_done else None,
                "shared_dir": str(launch.paths.directory)}
        launch.paths.write_file(SPEC_NAME, json.dumps(spec).encode())
        spec_path = launch.paths.directory / SPEC_NAME
        argv = allocation.srun_command(plan.nodes, dict(plan.slurm),
                                       [sys.executable, "-m", "fanrun.backends.slurm.agent", str(spec_path)])
        return start_agents(argv, plan.nodes, per_node, launch.paths, launch.wakeup_fd,
                            spec["env"][rank_tracking.VARIABLE] if spec["tracked"] else None)
