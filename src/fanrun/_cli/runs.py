"""`fanrun submit`, `list`, `logs`, `attach`, `cancel`: detached runs from a shell (_detached/)."""

from __future__ import annotations

import argparse
import os
import sys

# What `fanrun attach` exits with, by the run's status: a script can tell how the run ended.
EXIT_STATUS = {"FINISHED": 0, "FAILED": 1, "KILLED": 130}
COMMANDS = ("submit", "list", "logs", "attach", "cancel")


def add_commands(commands: argparse._SubParsersAction) -> None:
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
    listing = commands.add_parser("list", help="your detached runs (@distributed(detach=True))",
                                  description="Your detached runs still queued or running; --all: every one.")
    listing.add_argument("--all", action="store_true", help="also the runs that have ended")
    logs = commands.add_parser("logs", help="a detached run's output", description="Prints a detached run's output.")
    logs.add_argument("run", metavar="RUN", help="the run's id, as `fanrun list` shows it")
    logs.add_argument("--rank", type=int, default=None, help="that rank's lines alone")
    logs.add_argument("-f", "--follow", action="store_true", help="go on printing as it comes, until the run ends")
    attach = commands.add_parser(
        "attach", help="follow a detached run to its end",
        description="Prints a detached run's output from its start, then as it comes; exits when the run ends, "
        "with 0 if it finished, 1 if it failed, 130 if it was cancelled.")
    attach.add_argument("run", metavar="RUN", help="the run's id")
    cancel = commands.add_parser("cancel", help="stop a detached run", description="Stops a detached run's ranks.")
    cancel.add_argument("run", metavar="RUN", help="the run's id")


def main(options: argparse.Namespace) -> int:
    from .._errors import FanrunError, UnknownRunError
    from .._detached import run as runs
    from .._display.terminal_text import printable

    try:
        if options.command == "submit":
            return _submit(options)
        if options.command == "list":
            found = runs.runs(all=options.all)
            if found:
                print("\n".join(runs.table(found)))
            else:
                print(f"fanrun: no runs {'at all' if options.all else 'queued or running (--all: those that ended too)'}",
                      file=sys.stderr)
            return 0
        run = runs.Run(options.run)
        if options.command == "logs":
            if options.follow:
                run.logs(rank=options.rank, follow=True)
            else:
                sys.stdout.write(printable(run.logs(rank=options.rank)))
            return 0
        if options.command == "attach":
            run.logs(follow=True)
            status = run.wait()
        else:
            status = run.cancel()
        print(f"fanrun: run {run.id} {status}{_reason(run)}", file=sys.stderr)
        return EXIT_STATUS.get(status, 1) if options.command == "attach" else 0
    except UnknownRunError as error:
        print(f"fanrun: {printable(str(error), keep='')}", file=sys.stderr)
        return 2
    except FanrunError as error:  # a damaged run; a Ray job's cluster that does not answer
        print(f"fanrun: {printable(str(error), keep='')}", file=sys.stderr)
        return 1


def _submit(options: argparse.Namespace) -> int:
    from .._detached import run as runs
    from .._detached.workload import WorkloadError, load, spec_of

    try:
        workload = load(options.workload, options.override)
        if workload.nodes > 1:
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
    return _started(run, options)


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
    return _started(run, options)


def _folder(options: argparse.Namespace) -> str:
    """Where the workload runs: its file's folder, from which its relative paths are read."""
    return os.path.dirname(os.path.abspath(options.workload))


def _started(run, options: argparse.Namespace) -> int:
    print(run.id, flush=True)
    if not options.watch:
        return 0
    run.logs(follow=True)
    status = run.wait()
    print(f"fanrun: run {run.id} {status}{_reason(run)}", file=sys.stderr)
    return EXIT_STATUS.get(status, 1)


def _reason(run) -> str:
    """Why the run ended as it did, as one line: a rank's exception text, without its control characters."""
    from .._display.terminal_text import printable

    reason = run.info.get("reason")
    return f": {printable(reason, keep='')}" if reason else ""
