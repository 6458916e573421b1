"""The local backend: every rank on this machine, started and supervised by the engine
(cpp/include/fanrun/supervisor.h), each under a keeper of its own, with a rendezvous on 127.0.0.1
that the caller holds for the run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .. import _core
from .._accelerators import Plan
from .._launch.paths import RunPaths
from .._launch.rendezvous import Rendezvous
from .._rank import contract
from .._rank.worker import STACK_DUMP_SIGNAL
from .base import KILL_GRACE_S, STACK_DUMP_WAIT_S, Launch

# Each rank runs under a keeper of its own, which ends every process the rank started when the
# rank ends or the caller dies (cpp/include/fanrun/kept_process.h).
KEEPER = str(Path(__file__).parent.parent / "fanrun-keeper")

# Set in every rank unless the caller set them (Megatron-LM measured 1012 s vs 26 s
# without OMP_NUM_THREADS when ranks oversubscribe the cores).
RANK_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "PYTHONUNBUFFERED": "1",
    # A single-node run talks over loopback only.
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}



class LocalBackend:
    name = "local"

    def start(self, plan: Plan, launch: Launch) -> LocalRanks:
        rendezvous = Rendezvous(host_store=launch.program.python)
        try:
            envs = [
                _flatten(rank_environment(launch.env, rank, plan, rendezvous.environment(), launch.paths))
                for rank in range(plan.world_size)
            ]
            rendezvous.release_port_for_ranks()
            supervisor = _core.Supervisor.start(
                argvs=[launch.program.argv] * plan.world_size,
                envs=envs,
                cwd=os.getcwd(),
                log_paths=[str(launch.paths.log(r)) for r in range(plan.world_size)],
                timeout_s=float(launch.timeout) if launch.timeout is not None else 0.0,
                kill_grace_s=KILL_GRACE_S,
                stack_dump_signal=int(STACK_DUMP_SIGNAL) if launch.program.python else 0,
                stack_dump_wait_s=STACK_DUMP_WAIT_S,
                wakeup_fd=launch.wakeup_fd,
                control_channel=True,
                expect_done=launch.expect_done,
                keeper=KEEPER,
            )
        except BaseException:
            rendezvous.close()
            raise
        return LocalRanks(supervisor, rendezvous)


class LocalRanks:
    """The engine's supervisor of this machine's ranks, and the rendezvous they meet at."""

    def __init__(self, supervisor, rendezvous: Rendezvous) -> None:
        self._supervisor = supervisor
        self._rendezvous = rendezvous
        self.world_size = supervisor.world_size

    def wait(self, max_wait_s: float = -1.0):
        return self._supervisor.wait(max_wait_s)

    def cancel(self) -> None:
        self._supervisor.cancel()

    def kill_and_reap(self) -> None:
        self._supervisor.kill_and_reap()

    @property
    def stop_reason(self) -> _core.StopReason:
        return self._supervisor.stop_reason

    @property
    def first_failed_rank(self) -> int:
        return self._supervisor.first_failed_rank

    @property
    def ranks_running_at_timeout(self) -> list[int]:
        return list(self._supervisor.ranks_running_at_timeout)

    def pid(self, rank: int) -> int:
        return self._supervisor.pid(rank)

    def exit_status(self, rank: int) -> tuple[int, int] | None:
        return self._supervisor.exit_status(rank)

    def close(self) -> None:
        self._rendezvous.close()


def rank_environment(
    base: Mapping[str, str], rank: int, plan: Plan, rendezvous: Mapping[str, str], paths: RunPaths
) -> dict[str, str]:
    """torchrun's variables for one rank of a single-node run, on top of the caller's environment."""
    env = dict(base)
    for key, value in RANK_DEFAULTS.items():
        env.setdefault(key, value)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    world = str(plan.world_size)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=world,
        LOCAL_WORLD_SIZE=world,
        GROUP_RANK="0",
        NODE_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=world,
        TORCHELASTIC_RUN_ID=paths.run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    env[contract.ENV_RUN_ID] = paths.run_id
    env[contract.ENV_RUN_DIR] = str(paths.directory)
    env[contract.ENV_CONTROL_FD] = str(contract.CONTROL_FD)
    env[contract.ENV_ACCELERATOR] = "gpu" if plan.use_gpus else "cpu"
    env.update(rendezvous)
    if not plan.use_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, even on a machine with GPUs
    return env



def _flatten(env: Mapping[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in env.items()]
