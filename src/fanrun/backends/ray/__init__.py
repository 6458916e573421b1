"""The Ray backend: a call's ranks spread over the nodes of a Ray cluster, `world_size / nodes` on
each, with one agent per node that runs them with the engine's own supervisor.

  connect.py      fanrun.ray_init / ray_shutdown: this process's connection to a cluster
  placement.py    the placement group (one bundle per node, STRICT_SPREAD) and the node agents
  node_agent.py   the actor on each node: the engine's supervisor for that node's ranks
  ranks.py        the caller's view of every node's ranks, as the launcher drives them

Ray is imported when a call uses it, never by `import fanrun`.
"""

from __future__ import annotations

import sys

from ..._accelerators import DEFAULT_CPU_RANKS, AcceleratorRequest, Plan
from ..._errors import AcceleratorMismatchError, NodeEnvironmentError
from ..._rank import tracking as rank_tracking
from ..base import Launch
from ..node_agent import agent_spec
from ..node_ranks import check_health
from . import connect, placement
from .ranks import Node, RayRanks
from ..versions import differences, installed_versions

# How long the agents may take to start and describe their nodes.
AGENT_START_S = 120.0


def plan(num_accelerators: int | None, request: AcceleratorRequest | None, nodes: int,
         placement_timeout_s: float) -> Plan:
    """The plan of a call on the connected cluster: `num_accelerators` ranks in all (by default
    every GPU of a node, or DEFAULT_CPU_RANKS CPU processes, on each node). The decorator has
    checked that a given count is a multiple of `nodes`."""
    ray = connect.import_ray()
    if not ray.is_initialized():
        connect.ray_init()  # backend="ray" without a connection: $RAY_ADDRESS, or a head here
    cpu = request is not None and request.cpu
    use_gpus = not cpu and ray.cluster_resources().get("GPU", 0) > 0
    if request is not None and not cpu and not use_gpus:
        raise AcceleratorMismatchError(
            f"accelerator_type {request.text!r} asks for GPUs, but the Ray cluster has none; "
            f"pass accelerator_type='CPU' to run CPU processes on its nodes"
        )
    if num_accelerators is None:
        per_node = _most_gpus_on_a_node(ray) if use_gpus else DEFAULT_CPU_RANKS
        num_accelerators = per_node * nodes
    per_node = num_accelerators // nodes
    unit = "GPU" if use_gpus else ("CPU process" if per_node == 1 else "CPU processes")
    noun = "node" if nodes == 1 else "nodes"
    description = f"{nodes} Ray {noun} x {per_node} {unit}{'s' if use_gpus and per_node != 1 else ''}"
    kind = f"GPU_{num_accelerators}x{_gpu_model(ray)}" if use_gpus else "CPU"
    notice = ""
    if not use_gpus and not cpu:
        notice = f'no GPU in the Ray cluster: {description}; use the gloo backend (init_process_group("gloo"))'
    return Plan(num_accelerators, use_gpus, description, kind, notice, nodes=nodes, backend="ray",
                placement_timeout_s=placement_timeout_s)


class RayBackend:
    name = "ray"

    def start(self, launch: Launch) -> RayRanks:
        plan = launch.plan
        ray = connect.import_ray()
        per_node = plan.world_size // plan.nodes
        group = placement.place(ray, plan.nodes, per_node, plan.use_gpus, plan.placement_timeout_s)
        agents = []
        try:
            agents = placement.start_agents(ray, group, plan.nodes, per_node, plan.use_gpus)
            nodes = _describe(ray, agents)
            level = launch.call.options.health
            health = ray.get([agent.check_health.remote(level, per_node if plan.use_gpus else 0) for agent in agents])
            check_health({node.describe(): found for node, found in zip(nodes, health, strict=True)},
                         "Leave an unhealthy node out of the cluster (`ray stop` on it)")
            master_addr = nodes[0].address
            master_port = ray.get(agents[0].hold_rendezvous.remote(master_addr))
            payload = ray.put(launch.paths.payload.read_bytes()) if launch.expect_done else None
            spec = {**agent_spec(launch), "master_addr": master_addr, "master_port": master_port}
            env, tracked, layout = spec["env"], spec["tracked"], spec["layout"]
            started = ray.get([
                agent.start.remote({**spec, "layout": {**layout, "node_rank": node.rank}, "node_id": node.node_id}, payload)
                for agent, node in zip(agents, nodes, strict=True)
            ])
            pids = [pid for node_pids in started for pid in node_pids]
            link = None
            if tracked:
                from ..metric_link import MetricLink

                def publish(answer: dict) -> None:
                    for agent in agents:
                        agent.publish.remote(answer)

                link = MetricLink(env[rank_tracking.VARIABLE], publish)
            _announce(nodes, per_node)
            ranks = RayRanks(ray, agents, nodes, per_node, pids, launch.paths, launch.wakeup_fd, group, link)
            ranks.gpu_verdicts = dict(enumerate(health))
            return ranks
        except BaseException:
            placement.release(ray, agents, group)
            raise


def _describe(ray, agents: list) -> list[Node]:
    """Each agent's node, once every one runs; a node that cannot run fanrun, or runs other
    versions than the caller, stops the call here, before any rank starts."""
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        found = ray.get([agent.describe.remote() for agent in agents], timeout=AGENT_START_S)
    except RayActorError as error:
        raise NodeEnvironmentError(
            f"a node could not start fanrun's agent: {error}. Install fanrun, with the same Python, torch "
            f"and cloudpickle as here, on every node of the cluster"
        ) from None
    except GetTimeoutError:
        raise NodeEnvironmentError(f"the node agents did not start within {AGENT_START_S:g} s") from None
    mine = installed_versions()
    for index, facts in enumerate(found):
        wrong = differences(mine, facts["versions"])
        if wrong:
            raise NodeEnvironmentError(
                f"node {index} ({facts['address']}, host {facts['hostname']}) has {', '.join(wrong)}. Every node "
                f"must run the caller's versions of Python, torch, cloudpickle and fanrun: install the same ones there"
            )
    return [Node(index, facts["node_id"], facts["address"], facts["hostname"]) for index, facts in enumerate(found)]


def _most_gpus_on_a_node(ray) -> int:
    return int(max((node["Resources"].get("GPU", 0) for node in ray.nodes() if node.get("Alive")), default=0))


def _gpu_model(ray) -> str:
    """The model Ray found on the cluster's GPUs ('H200'), from its accelerator_type resource."""
    prefix = "accelerator_type:"
    models = sorted(key[len(prefix):] for key in ray.cluster_resources() if key.startswith(prefix))
    return models[0] if models else "GPU"


def _announce(nodes: list[Node], per_node: int) -> None:
    """One line before the ranks' output: which ranks run on which node."""
    where = ", ".join(
        f"ranks {n.rank * per_node}-{(n.rank + 1) * per_node - 1} on {n.describe()}" if per_node > 1
        else f"rank {n.rank} on {n.describe()}"
        for n in nodes
    )
    world = len(nodes) * per_node
    ranks = "1 rank" if world == 1 else f"{world} ranks"
    machines = "1 Ray node" if len(nodes) == 1 else f"{len(nodes)} Ray nodes"
    print(f"fanrun: {ranks} on {machines}: {where}", file=sys.stderr, flush=True)
