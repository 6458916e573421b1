"""The Ray actor on each node of a Ray call: node_agent.py's NodeAgent, which also describes its
node to the caller.

Ray kills actors, not what they started: the keepers under the agent end the ranks when it goes.
"""

from __future__ import annotations

import socket

from ..node_agent import NodeAgent
from ..versions import installed_versions

# A Ray worker that exits SIGKILLs its child processes, here the ranks' keepers, which then
# cannot end what the ranks started. Left alone, each keeper sees its agent go and ends all of it.
AGENT_ENV = {"RAY_kill_child_processes_on_worker_exit": "0"}


class RayNodeAgent(NodeAgent):
    # Ray's setting for the agent alone, and the OpenMP threads of a worker that holds every CPU
    # of the node, which would oversubscribe the cores once per rank.
    dropped_env = (*AGENT_ENV, "OMP_NUM_THREADS")

    def describe(self) -> dict:
        """The node, and the versions that must match the caller's."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "versions": installed_versions(),
        }
