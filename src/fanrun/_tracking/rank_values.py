"""The params and tags that the ranks log on the call's run, written when the run is closed.

One rule names what every rank logs under one key (docs/tracking.md): the key holds rank 0's
values, and rank N's go under `key/rank_N`. A rank renames its own metrics (_rank/tracking.py,
rank_suffix), since two ranks' values under one key would make one series with two values per
step. Its params and tags reach the agent instead of the store (metric_relay.py keeps them), so
that no rank opens the store for them (_rank/call_store.py), and here, once every rank has
ended, rank 0's go under `key` and each other rank's goes under `key/rank_N` only where it
differs from the run's value under `key` (or there is none): the same hyperparameters logged by
every rank stay one param. Two ranks' values of one param would otherwise fail the call with
MLflow's "Changing param values is not allowed"; here they are a warning, one line per param.
"""

from __future__ import annotations

# MLflow's limits for one log_batch request.
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100
# How much of a value a warning shows (a param's may be 6000 characters).
SHOWN_VALUE_CHARS = 80


def write_rank_values(client, run_id: str, run_name: str, keyed: list[tuple]) -> list[str]:
    """Writes `keyed`, ("param" | "tag", rank, key, value) records, by the rule; returns the
    warnings about params whose value differs from rank 0's."""
    if not keyed:
        return []
    from mlflow.entities import Param, RunTag

    by_key: dict[str, dict[str, dict[int, str]]] = {"param": {}, "tag": {}}
    for kind, rank, key, value in keyed:
        by_key[kind].setdefault(key, {})[rank] = value  # a tag set again: its last value stands
    data = client.get_run(run_id).data
    # A param is never changed: one the run holds already (a resumed run's) stays.
    own_params = {key: ranks[0] for key, ranks in by_key["param"].items() if 0 in ranks and key not in data.params}
    own_tags = {key: ranks[0] for key, ranks in by_key["tag"].items() if 0 in ranks}
    run_params, run_tags = {**data.params, **own_params}, {**data.tags, **own_tags}
    params = [Param(key, value) for key, value in own_params.items()]
    params += [Param(f"{key}/rank_{rank}", value)
               for key, ranks in by_key["param"].items() for rank, value in sorted(ranks.items())
               if rank != 0 and run_params.get(key) != value and f"{key}/rank_{rank}" not in data.params]
    tags = [RunTag(key, value) for key, value in own_tags.items()]
    tags += [RunTag(f"{key}/rank_{rank}", value)
             for key, ranks in by_key["tag"].items() for rank, value in sorted(ranks.items())
             if rank != 0 and run_tags.get(key) != value]
    for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])
    for start in range(0, len(tags), MAX_TAGS_PER_BATCH):
        client.log_batch(run_id, tags=tags[start : start + MAX_TAGS_PER_BATCH])
    warnings = []
    for key, ranks in by_key["param"].items():
        if key not in run_params:
            continue
        differing = {rank: value for rank, value in sorted(ranks.items()) if rank != 0 and value != run_params[key]}
        if differing:
            values = ", ".join([f"rank 0: {_shown(run_params[key])}"] + [f"rank {r}: {_shown(v)}" for r, v in differing.items()])
            warnings.append(f"fanrun: parameter {key!r} differs by rank ({values}) on the MLflow run {run_name}: "
                            f"{key!r} holds rank 0's value, '{key}/rank_N' rank N's.")
    return warnings


def _shown(value: str) -> str:
    return repr(value if len(value) <= SHOWN_VALUE_CHARS else value[: SHOWN_VALUE_CHARS - 3] + "...")
