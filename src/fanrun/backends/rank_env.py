"""Every rank's environment: torchrun's variables for its place among the run's nodes, fanrun's
own (the run contract), and defaults that keep ranks from fighting over the machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .._accelerators import Plan
from .._spec.paths import RunPaths
from .._rank import contract

# Set in every rank unless the caller set them (Megatron-LM measured 1012 s vs 26 s
# without OMP_NUM_THREADS when ranks oversubscribe the cores).
RANK_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "PYTHONUNBUFFERED": "1",
}

# The caller's variables that go to every node's ranks on a cluster: those the call sets
# (Launch.added), and those that configure the libraries a training function uses. The rest of a
# rank's environment is its node's own, as the cluster gives it to the agent (PATH, HOME,
# CUDA_VISIBLE_DEVICES for the node's GPUs).
FORWARDED_PREFIXES = (
    "FANRUN_", "MLFLOW_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "CUDA_LAUNCH_BLOCKING", "CUBLAS_",
    "OMP_", "MKL_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "WANDB_", "PYTHONHASHSEED",
)


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """One node's share of a run: ranks first_rank .. first_rank + local_world_size - 1."""

    node_rank: int
    nodes: int
    local_world_size: int
    world_size: int
    use_gpus: bool
    # The network interface the ranks of this node reach node 0 through ("lo" on one machine;
    # empty where it could not be told, and gloo and NCCL choose).
    interface: str

    @classmethod
    def single(cls, plan: Plan) -> NodeLayout:
        return cls(0, 1, plan.world_size, plan.world_size, plan.use_gpus, "lo")

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.local_world_size


def rank_environment(
    base: Mapping[str, str], layout: NodeLayout, rank: int, rendezvous: Mapping[str, str], paths: RunPaths
) -> dict[str, str]:
    """The environment of global rank `rank`, on top of `base`."""
    env = dict(base)
    for key, value in RANK_DEFAULTS.items():
        env.setdefault(key, value)
    # Where node 0 is reached: loopback on one machine, else the interface towards it.
    if layout.interface:
        env.setdefault("GLOO_SOCKET_IFNAME", layout.interface)
        env.setdefault("NCCL_SOCKET_IFNAME", layout.interface)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.pop(contract.ENV_KEEP_ALIVE, None)  # a call made from inside a kept rank keeps nothing unless asked
    local_rank = rank - layout.first_rank
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(layout.world_size),
        LOCAL_WORLD_SIZE=str(layout.local_world_size),
        GROUP_RANK=str(layout.node_rank),
        NODE_RANK=str(layout.node_rank),
        GROUP_WORLD_SIZE=str(layout.nodes),
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(layout.world_size),
        TORCHELASTIC_RUN_ID=paths.run_id,
        # torchrun's names for fanrun's attempt count and restart limit (run.run sets both).
        TORCHELASTIC_RESTART_COUNT=env.get(contract.ENV_RESTART_COUNT, "0"),
        TORCHELASTIC_MAX_RESTARTS=env.get(contract.ENV_MAX_RESTARTS, "0"),
    )
    env[contract.ENV_RUN_ID] = paths.run_id
    env[contract.ENV_RUN_DIR] = str(paths.directory)
    env[contract.ENV_CONTROL_FD] = str(contract.CONTROL_FD)
    env[contract.ENV_ACCELERATOR] = "gpu" if layout.use_gpus else "cpu"
    env.update(rendezvous)
    if not layout.use_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, even on a machine with GPUs
    return env


def flatten(env: Mapping[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in env.items()]
