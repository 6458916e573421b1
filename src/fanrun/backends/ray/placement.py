"""Where a call's ranks go on a Ray cluster: a STRICT_SPREAD placement group with one bundle per
node (each bundle on a distinct node), and one NodeAgent in each. A cluster that cannot fit the
call within the placement timeout is an error that says what was asked and what is free."""

from __future__ import annotations

import collections

from ..._errors import ClusterResourcesError

# An agent runs several methods at once: next_batch waits for news while cancel or publish come.
AGENT_CONCURRENCY = 8


def bundle(ranks_per_node: int, use_gpus: bool) -> dict[str, float]:
    """What one node must have free: a GPU per rank, or a CPU per rank."""
    return {"GPU": float(ranks_per_node)} if use_gpus else {"CPU": float(ranks_per_node)}


def place(ray, nodes: int, ranks_per_node: int, use_gpus: bool, timeout_s: float):
    """The placement group, ready; or ClusterResourcesError once `timeout_s` has passed."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([bundle(ranks_per_node, use_gpus)] * nodes, strategy="STRICT_SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ClusterResourcesError(
            f"the Ray cluster could not fit the call within placement_timeout={timeout_s:g} s: asked "
            f"{_asked(nodes, ranks_per_node, use_gpus)}; free: {free_now(ray, use_gpus)}. Ask for fewer "
            f"nodes or ranks, add nodes to the cluster, or raise placement_timeout if nodes are still joining"
        )
    return group


def start_agents(ray, group, nodes: int, ranks_per_node: int, use_gpus: bool) -> list:
    """One NodeAgent per bundle: agent i runs node i's ranks, with the bundle's resources."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .node_agent import AGENT_ENV, RayNodeAgent

    agent_class = ray.remote(RayNodeAgent)
    resources = {"num_gpus": ranks_per_node, "num_cpus": 0} if use_gpus else {"num_cpus": ranks_per_node}
    return [
        agent_class.options(
            **resources,
            max_concurrency=AGENT_CONCURRENCY,
            runtime_env={"env_vars": AGENT_ENV},
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote()
        for index in range(nodes)
    ]


def release(ray, agents: list, group) -> None:
    """The agents killed (their keepers end whatever ranks they still run) and the group's
    resources given back."""
    from ray.util.placement_group import remove_placement_group

    for agent in agents:
        ray.kill(agent, no_restart=True)
    remove_placement_group(group)


def _asked(nodes: int, ranks_per_node: int, use_gpus: bool) -> str:
    noun = "node" if nodes == 1 else "nodes"
    unit = "GPU" if use_gpus else "CPU"
    return f"{nodes} {noun} x {ranks_per_node} {unit}{'s' if ranks_per_node != 1 else ''}"


def free_now(ray, use_gpus: bool) -> str:
    """'1 node with 2 GPUs, 1 node with 0 GPUs': what each alive node has free now."""
    unit = "GPU" if use_gpus else "CPU"
    try:
        from ray._private.state import available_resources_per_node

        per_node = [resources.get(unit, 0.0) for resources in available_resources_per_node().values()]
    except (ImportError, AttributeError):  # a Ray without it: each node's total instead
        per_node = [node["Resources"].get(unit, 0.0) for node in ray.nodes() if node.get("Alive")]
    if not per_node:
        return "no node"
    counts = collections.Counter(int(amount) for amount in per_node)
    parts = []
    for amount, count in sorted(counts.items(), reverse=True):
        noun = "node" if count == 1 else "nodes"
        parts.append(f"{count} {noun} with {amount} {unit}{'s' if amount != 1 else ''}")
    return ", ".join(parts)
