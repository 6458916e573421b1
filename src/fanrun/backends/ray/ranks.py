"""RayRanks: a Ray call's ranks (node_ranks.py's NodeRanks), one thread per node agent long-polling
its news (next_batch)."""

from __future__ import annotations

import threading

from ..._spec.paths import RunPaths
from ..node_ranks import Node, NodeRanks
from . import placement
from ..metric_link import MetricLink


class RayRanks(NodeRanks):
    node_id_label = "Ray node id"

    def __init__(self, ray, agents: list, nodes: list[Node], ranks_per_node: int, pids: list[int],
                 paths: RunPaths, wakeup_fd: int, group, link: MetricLink | None) -> None:
        super().__init__(nodes, ranks_per_node, pids, paths, wakeup_fd, link)
        self._ray = ray
        self._agents = agents
        self._group = group
        self._news_threads = [
            threading.Thread(target=self._follow, args=(node,), name=f"fanrun-node-{node}", daemon=True)
            for node in range(len(nodes))
        ]
        for follower in self._news_threads:
            follower.start()

    def kill_and_reap(self) -> None:
        self._tell_others("kill", stopped=None)
        # The agents go, and with them, through their keepers, every rank still there.
        for agent in self._agents:
            self._ray.kill(agent, no_restart=True)

    def _release(self) -> None:
        placement.release(self._ray, self._agents, self._group)

    def _follow(self, node: int) -> None:
        agent = self._agents[node]
        while not self._closed:
            try:
                batch, ending = self._ray.get(agent.next_batch.remote())
            except Exception as error:  # the actor died, or its node left the cluster
                self._post(("lost", node, f"its agent died or the node left the cluster ({type(error).__name__})"))
                return
            self._post(("batch", node, batch))
            if ending is not None:
                self._post(("ended", node, ending))
                return

    def _command(self, node: int, command: str) -> None:
        getattr(self._agents[node], command).remote()
