"""Where a call's ranks run. Each backend starts the ranks of one attempt of a call (_spec's Launch),
streams their output, reports their events and stops them, behind one interface (base.py);
the launcher (fanrun._launch) drives any of them the same way.

  local/         this machine: the engine's supervisor, one keeper per rank, spare and kept ranks
  ray/           the nodes of a Ray cluster: one agent per node runs that node's ranks as local/ does
  slurm/         the nodes of a Slurm allocation: srun starts one agent per node, as Ray's
  node_agent.py  what runs one node's ranks of a multi-node call, for ray/ and slurm/
  node_ranks.py  a multi-node call's ranks as the launcher drives them, for ray/ and slurm/
  metric_link.py what a cluster's ranks log to MLflow, from the nodes to the caller's tracking agent
  versions.py    the versions every node of a cluster call must share with the caller
  metric_relay.py  the host's end of the ranks' metric stream, a socket server that knows nothing of MLflow
  rank_env.py    every rank's environment, for its place among the run's nodes
  stack_dump.py  signalling a rank on its own machine for its stack, reading the dump back as it
                 grows, and why a rank cannot dump it
  rank_evidence.py  a stalled call's evidence, asked of the ranks on their own machine
"""

from __future__ import annotations

from .base import Backend, Launch, Ranks
from .local import LocalBackend


def for_plan(plan) -> Backend:
    """The backend that runs this plan."""
    if plan.backend == "ray":
        from .ray import RayBackend

        return RayBackend()
    if plan.backend == "slurm":
        from .slurm import SlurmBackend

        return SlurmBackend()
    if plan.nodes != 1:
        raise ValueError(f"a plan of {plan.nodes} nodes needs a cluster backend; this machine runs one node")
    return LocalBackend()


__all__ = ["Backend", "Launch", "Ranks", "LocalBackend", "for_plan"]
