"""The local backend: every rank on this machine, started and supervised by the engine
(cpp/include/fanrun/supervisor.h), each under a keeper of its own, with a rendezvous on 127.0.0.1
that the caller holds for the run. A warm call's ranks are spares where there are some
(backends/local/spares.py), and it leaves as many spares for the next call. A call with keep_alive
runs on the ranks the function's last call kept, and keeps its own for the next one."""

from __future__ import annotations

import os
from pathlib import Path

from ... import _core
from ..._accelerators import Plan
from . import spares as spare_ranks
from .rendezvous import Rendezvous
from ..._rank import contract
from ..._rank.contract import STACK_DUMP_SIGNAL
from .. import stack_dump
from ..base import KILL_GRACE_S, STACK_DUMP_WAIT_S, Launch
from ..rank_env import RANK_DEFAULTS, NodeLayout, flatten, rank_environment

# Each rank runs under a keeper of its own, which ends every process the rank started when the
# rank ends or the caller dies (cpp/include/fanrun/kept_process.h).
KEEPER = str(Path(__file__).parents[2] / "fanrun-keeper")


class LocalBackend:
    name = "local"

    def start(self, launch: Launch) -> LocalRanks:
        plan = launch.plan
        rendezvous = Rendezvous(host_store=launch.program.python)
        keep = launch.keep if launch.expect_done else None  # a function's ranks alone take further calls
        try:
            envs = [
                flatten(rank_environment(launch.env, NodeLayout.single(plan), rank, rendezvous.environment(), launch.paths))
                for rank in range(plan.world_size)
            ]
            if keep is not None:
                for env in envs:
                    env.append(f"{contract.ENV_KEEP_ALIVE}=1")
            cwd = os.getcwd()
            options = _core.SupervisorOptions(
                ranks=[_core.RankOptions(argv=launch.program.argv, env=env, cwd=cwd, log_path=str(launch.paths.log(rank)))
                       for rank, env in enumerate(envs)],
                keeper_path=KEEPER,
                timeout_s=float(launch.timeout) if launch.timeout is not None else 0.0,
                kill_grace_s=KILL_GRACE_S,
                stack_dump_signal=int(STACK_DUMP_SIGNAL) if launch.program.python else 0,
                stack_dump_wait_s=STACK_DUMP_WAIT_S,
                wakeup_fd=launch.wakeup_fd,
                expect_done=launch.expect_done,
            )
            rendezvous.release_port_for_ranks()
            warm = launch.warm and launch.program.python
            spares = _spares_for(plan, keep, warm)
            try:
                supervisor = _core.Supervisor.start(options, spares=spares)
            except Exception:
                if not spares:
                    raise
                # A spare ended between its check and its call (killed from outside): the call
                # starts afresh, and what a fresh start cannot do is the error.
                spare_ranks.POOL.drop()
                supervisor = _core.Supervisor.start(options, spares=_spares_for(plan, keep, warm=False))
        except BaseException:
            rendezvous.close()
            raise
        return LocalRanks(supervisor, rendezvous, refill=plan.world_size if warm and keep is None else 0,
                          keep=keep, keep_key=_keep_key(plan))


def _spares_for(plan: Plan, keep: spare_ranks.KeptRanks | None, warm: bool) -> list:
    """The spares a call's ranks become: with keep_alive, the ones the last call kept, else spares
    started now (a kept rank is one that was a spare), from the warm pool first where the call is
    warm; without, the warm pool's."""
    if keep is None:
        return spare_ranks.POOL.take(plan.world_size) if warm else []
    kept = keep.take(_keep_key(plan))
    if kept:
        return kept
    spares = spare_ranks.POOL.take(plan.world_size) if warm else []
    return spares + spare_ranks.POOL.start(plan.world_size - len(spares), KEEPER, RANK_DEFAULTS)


def _keep_key(plan: Plan) -> tuple:
    """What a call must share with the last one to take the ranks it kept: rank i had device i."""
    return plan.world_size, plan.use_gpus, plan.description


class LocalRanks:
    """The engine's supervisor of this machine's ranks, and the rendezvous they meet at."""

    def __init__(self, supervisor, rendezvous: Rendezvous, refill: int, keep: spare_ranks.KeptRanks | None,
                 keep_key: tuple) -> None:
        self._supervisor = supervisor
        self._rendezvous = rendezvous
        self._refill = refill
        self._keep = keep
        self._keep_key = keep_key
        self.world_size = supervisor.world_size
        self.failure = None  # every end of a local run is a rank's

    def wait(self, max_wait_s: float = -1.0, gather_s: float = 0.0):
        return self._supervisor.wait(max_wait_s, gather_s)

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

    def location(self, rank: int) -> str:
        return f"pid {self.pid(rank)}"

    def stack_dump_obstacle(self, rank: int) -> str | None:
        return stack_dump.obstacle(self.pid(rank), STACK_DUMP_SIGNAL)

    def close(self) -> None:
        self._rendezvous.close()
        if self._keep is not None:
            kept = self._supervisor.release_kept()  # none unless the call ended well
            if kept:
                self._keep.keep(self._keep_key, kept)
            self._supervisor.kill_and_reap()  # the ranks it kept, where the call did not end well
        if self._refill:
            # The next call's ranks start importing now, while this call's caller reads its results.
            spare_ranks.POOL.fill_soon(self._refill, KEEPER, RANK_DEFAULTS)
