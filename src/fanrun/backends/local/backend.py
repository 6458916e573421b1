"""The local backend: every rank on this machine, started and supervised by the engine
(cpp/include/fanrun/supervisor.h), each under a keeper of its own, with a rendezvous on 127.0.0.1
that the caller holds for the run. A warm call's ranks are spares where there are some
(backends/local/spares.py), and as it starts, as many spares start for the next call. A call with keep_alive
runs on the ranks the function's last call kept, and keeps its own for the next one."""

from __future__ import annotations

import os
from pathlib import Path

from ... import _core
from ..._accelerators import Plan
from . import spares as spare_ranks
from .rendezvous import Rendezvous
from .survivors import Survivors
from ..._rank import contract
from ..._rank.contract import ABANDON_SIGNAL, STACK_DUMP_SIGNAL
from .. import rank_evidence, stack_dump
from ..base import FAILURE_EVIDENCE_S, KILL_GRACE_S, STACK_DUMP_WAIT_S, Launch
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
        # A function's ranks alone restart in their processes, and only where each is a spare.
        survivors = launch.survivors if launch.expect_done and launch.program.python else None
        survive = survivors is not None and survivors.another_follows
        try:
            envs = [
                flatten(rank_environment(launch.env, NodeLayout.single(plan), rank, rendezvous.environment(), launch.paths))
                for rank in range(plan.world_size)
            ]
            if keep is not None:
                for env in envs:
                    env.append(f"{contract.ENV_KEEP_ALIVE}=1")
            if survive:
                for env in envs:
                    env.append(f"{contract.ENV_KEEP_SURVIVORS}=1")
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
                abandon_signal=int(ABANDON_SIGNAL) if survive else 0,
                # Ranks that answer forensics say what they were doing when the first failure came.
                failure_evidence_s=FAILURE_EVIDENCE_S if launch.env.get(contract.ENV_PROGRESS) == "1" else 0.0,
            )
            rendezvous.release_port_for_ranks()
            warm = launch.warm and launch.program.python
            if warm or keep is not None or survive:
                # The spares started from here on import mlflow where this call is tracked.
                spare_ranks.POOL.mlflow = launch.env.get(contract.ENV_TRACKING, "off") != "off"
            spares = _spares_for(plan, keep, warm, survivors)
            try:
                supervisor = _core.Supervisor.start(options, spares=spares)
            except Exception:
                if not spares:
                    raise
                # A spare ended between its check and its call (killed from outside): the call
                # starts afresh, and what a fresh start cannot do is the error.
                spare_ranks.POOL.drop()
                supervisor = _core.Supervisor.start(options, spares=_spares_for(plan, keep, False, survivors))
        except BaseException:
            rendezvous.close()
            raise
        if warm and keep is None:
            # The next call's ranks import while this call runs: a call that follows at once finds
            # them ready as soon as this one has lasted as long as their imports.
            spare_ranks.POOL.fill_soon(plan.world_size, KEEPER, RANK_DEFAULTS)
        return LocalRanks(supervisor, rendezvous, keep=keep, keep_key=_keep_key(plan),
                          survivors=survivors if survive else None, directory=launch.paths.directory)


def _spares_for(plan: Plan, keep: spare_ranks.KeptRanks | None, warm: bool, survivors: Survivors | None) -> list:
    """The spares a call's ranks become. After a failed attempt, the ranks that survived it, at
    their ranks, and spares for the others. With keep_alive, the ones the last call kept, else
    spares started now (a kept rank, or a survivor, is one that was a spare), from the warm pool
    first where the call is warm; without either, the warm pool's."""
    if survivors is not None:
        held = survivors.take(plan.world_size)
        if any(spare is not None for spare in held):
            others = iter(_started(held.count(None), warm=True))  # a restart's spares started ahead (call.py)
            return [spare if spare is not None else next(others) for spare in held]
    elif keep is None:
        return spare_ranks.POOL.take(plan.world_size) if warm else []
    kept = keep.take(_keep_key(plan)) if keep is not None else []
    return kept or _started(plan.world_size, warm)


def _started(count: int, warm: bool) -> list:
    """`count` spares: from the warm pool first where the call is warm, the rest started now."""
    spares = spare_ranks.POOL.take(count) if warm else []
    return spares + spare_ranks.POOL.start(count - len(spares), KEEPER, RANK_DEFAULTS)


def _keep_key(plan: Plan) -> tuple:
    """What a call must share with the last one to take the ranks it kept: rank i had device i."""
    return plan.world_size, plan.use_gpus, plan.description


class LocalRanks:
    """The engine's supervisor of this machine's ranks, and the rendezvous they meet at."""

    def __init__(self, supervisor, rendezvous: Rendezvous, keep: spare_ranks.KeptRanks | None, keep_key: tuple,
                 survivors: Survivors | None, directory: Path) -> None:
        self._supervisor = supervisor
        self._directory = directory
        self._rendezvous = rendezvous
        self._keep = keep
        self._keep_key = keep_key
        self._survivors = survivors
        self.world_size = supervisor.world_size
        self.failure = None  # every end of a local run is a rank's
        self.gpu_verdicts: dict[int, list[dict]] = {}  # the call path's gate judged this machine's GPUs
        self.failure_evidence: dict[int, float] = {}

    def wait(self, max_wait_s: float = -1.0, gather_s: float = 0.0):
        news = self._supervisor.wait(max_wait_s, gather_s)
        if self._supervisor.gathering_failure_evidence:
            # The first failure has come and the others still run as they were: each says where
            # it waits (failure_peers.py reads it) before they are stopped.
            failed = self._supervisor.first_failed_rank
            running = [rank for rank in range(self.world_size) if rank != failed and self.exit_status(rank) is None]
            self.failure_evidence = rank_evidence.collectives_now(self._directory, running, FAILURE_EVIDENCE_S)
            self._supervisor.end_failure_evidence()
        return news

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

    def ask_for_evidence(self, ended) -> dict[int, rank_evidence.RankAnswer]:
        ranks = range(self.world_size)
        return rank_evidence.ask(self._directory, ranks, {rank: self.pid(rank) for rank in ranks if rank not in ended})

    def ask_for_collectives(self, ended) -> None:
        running = [rank for rank in range(self.world_size) if rank not in ended]
        rank_evidence.ask_for_collectives(self._directory, running)

    def close(self) -> None:
        self._rendezvous.close()
        if self._survivors is not None:
            if self._supervisor.stop_reason == _core.StopReason.RANK_FAILED:
                self._survivors.keep(self._supervisor.release_survivors())
            self._supervisor.kill_and_reap()  # the rank whose failure started it, kept till now
        if self._keep is not None:
            kept = self._supervisor.release_kept()  # none unless the call ended well
            if kept:
                self._keep.keep(self._keep_key, kept)
            self._supervisor.kill_and_reap()  # the ranks it kept, where the call did not end well
