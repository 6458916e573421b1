"""`fanrun list`, `logs`, `attach`, `cancel`: runs, blocking and detached, from a shell (_detached/run.py)."""

from __future__ import annotations

import argparse
import sys

# What `fanrun attach` exits with, by the run's status: a script can tell how the run ended.
EXIT_STATUS = {"FINISHED": 0, "FAILED": 1, "KILLED": 130}
COMMANDS = ("list", "logs", "attach", "cancel")


def add_parser(commands: argparse._SubParsersAction) -> None:
    listing = commands.add_parser("list", help="your runs, blocking and detached",
                                  description="Your runs still queued or running, blocking calls and detached runs "
                                  "alike; --all: the ones that have ended too (the newest 100 of them).")
    listing.add_argument("--all", action="store_true", help="also the runs that have ended")
    logs = commands.add_parser("logs", help="a run's output",
                               description="Prints a run's output, as a blocking call shows it, each line labelled by "
                               "its rank; a blocking call's is read back from its ranks' logs.")
    logs.add_argument("run", metavar="RUN", help="the run's id, as the run printed it and `fanrun list` shows it")
    logs.add_argument("--rank", type=int, default=None, help="that rank's lines alone")
    logs.add_argument("-f", "--follow", action="store_true", help="go on printing as it comes, until the run ends")
    attach = commands.add_parser(
        "attach", help="follow a run to its end",
        description="Prints a run's output from its start, then as it comes; exits when the run ends, "
        "with 0 if it finished, 1 if it failed, 130 if it was cancelled or interrupted.")
    attach.add_argument("run", metavar="RUN", help="the run's id")
    cancel = commands.add_parser("cancel", help="stop a detached run",
                                 description="Stops a detached run's ranks. A blocking call is stopped where it runs "
                                 "(Ctrl+C), as its caller waits for its results.")
    cancel.add_argument("run", metavar="RUN", help="the run's id")


def main(options: argparse.Namespace) -> int:
    from .._errors import FanrunError, UnknownRunError
    from .._detached import run as runs
    from .._display.terminal_text import printable

    try:
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
        print(f"fanrun: run {run.id} {status}{reason(run)}", file=sys.stderr)
        return EXIT_STATUS.get(status, 1) if options.command == "attach" else 0
    except UnknownRunError as error:
        print(f"fanrun: {printable(str(error), keep='')}", file=sys.stderr)
        return 2
    except FanrunError as error:  # a damaged run; a Ray job's cluster that does not answer
        print(f"fanrun: {printable(str(error), keep='')}", file=sys.stderr)
        return 1


def reason(run) -> str:
    """Why the run ended as it did, as one line: a rank's exception text, without its control characters."""
    from .._display.terminal_text import printable

    why = run.info.get("reason")
    return f": {printable(why, keep='')}" if why else ""


def started(run, *, watch: bool) -> int:
    """A detached run just started (`fanrun submit`, `fanrun run --detach`): its id on stdout, for a
    script to keep; with `watch`, its output until it ends, and the exit status attach gives."""
    try:
        print(run.id, flush=True)
        if not watch:
            return 0
        run.logs(follow=True)
        status = run.wait()
    except KeyboardInterrupt:
        print(f"fanrun: stopped watching; run {run.id} goes on: `fanrun attach {run.id}` follows it again, "
              f"`fanrun cancel {run.id}` stops it", file=sys.stderr)
        return 130
    print(f"fanrun: run {run.id} {status}{reason(run)}", file=sys.stderr)
    return EXIT_STATUS.get(status, 1)
