"""`fanrun submit WORKLOAD`: a detached run from a workload file (_detached/workload.py), on this
machine or, with compute.nodes above 1, as a Ray cluster's job, or as a detached run of this
machine whose ranks srun starts on Slurm's nodes (compute.backend: slurm)."""

from __future__ import annotations

import argparse
import os
import sys

from .runs import started


def add_parser(commands: argparse._SubParsersAction) -> None:
    submit = commands.add_parser(
        "submit", help="start a detached run from a workload file",
        description="Starts the run a workload file describes (docs/detached.md) and prints its id; it goes on "
        "when this command ends. A mistake in the file is an error before anything starts, naming its line.")
    submit.add_argument("workload", metavar="WORKLOAD", help="the workload file (YAML)")
    submit.add_argument("--watch", action="store_true", help="follow the run to its end, as `fanrun attach` does")
    submit.add_argument("--dry-run", action="store_true", help="check the file and show what would run; start nothing")
    submit.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                        help="replace a field of the file, such as compute.num_accelerators=4 (repeatable)")
    submit.add_argument("--idempotency-key", default=None, metavar="KEY",
                        help="a run already submitted with this key is returned instead of a new one")
    submit.add_argument("--ray-address", default=None, metavar="ADDRESS",
                        help="with compute.nodes above 1: the Ray cluster that runs it as a job, as `ray job submit` "
                        "takes it (its dashboard's http://head:8265; default $RAY_API_SERVER_ADDRESS or $RAY_ADDRESS)")


def main(options: argparse.Namespace) -> int:
    from .._detached import run as runs
    from .._detached.workload import WorkloadError, load, spec_of

    try:
        workload = load(options.workload, options.override)
        if workload.nodes > 1 and workload.backend != "slurm":
            return _submit_to_ray(workload, options)
        spec = spec_of(workload)
    except (WorkloadError, ValueError, TypeError) as error:
        print(f"fanrun: {error}", file=sys.stderr)
        return 2
    if options.dry_run:
        print(f"would run {workload.shown} on {spec.plan.description}, max_retries {workload.options.max_restarts}, "
              f"timeout {'none' if workload.options.timeout is None else f'{workload.options.timeout:g} s'}")
        return 0
    run = runs.submit(spec, cwd=_folder(options), idempotency_key=options.idempotency_key)
    return started(run, watch=options.watch)


def _submit_to_ray(workload, options: argparse.Namespace) -> int:
    """compute.nodes above 1: a job of the Ray cluster's own job system (_detached/ray_job.py)."""
    import json

    from .._errors import FanrunError
    from .._detached import run as runs

    address = options.ray_address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError(f"compute.nodes: {workload.nodes} runs as a job of a Ray cluster: pass --ray-address "
                         f"http://HEAD:8265 (its dashboard), or set RAY_ADDRESS as for `ray job submit`")
    try:
        json.dumps(workload.fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{options.workload}: a Ray job takes the workload's values as JSON, and one is not: {error}") from None
    ranks = workload.options.num_accelerators
    if options.dry_run:
        print(f"would submit {workload.name} to the Ray cluster at {address} as a job: "
              f"{ranks if ranks is not None else 'one rank per accelerator'} ranks over {workload.nodes} nodes, "
              f"max_retries {workload.options.max_restarts}")
        return 0
    try:
        run = runs.submit_to_ray(workload, cwd=_folder(options), ray_address=address,
                                 idempotency_key=options.idempotency_key)
    except FanrunError as error:
        print(f"fanrun: {error}", file=sys.stderr)
        return 1
    return started(run, watch=options.watch)


def _folder(options: argparse.Namespace) -> str:
    """Where the workload runs: its file's folder, from which its relative paths are read."""
    return os.path.dirname(os.path.abspath(options.workload))

