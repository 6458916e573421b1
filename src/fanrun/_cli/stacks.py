"""`fanrun stacks RUN`: where every rank of a running call is, without stopping it."""

from __future__ import annotations

import argparse
import sys

from .._errors import StacksError


def add_parser(commands: argparse._SubParsersAction) -> None:
    stacks = commands.add_parser(
        "stacks", help="print where every rank of a running call is, without stopping it",
        description="Makes every rank of the running call RUN dump the stacks of its threads (faulthandler) into "
        "its log, and prints them. RUN is the run's id, which the call printed as it started (`fanrun list` shows "
        "the runs that run). Where the run stalled, its last stall report comes first: the verdict, and every "
        "rank's stacks, last collectives and last lines as they were then; it is printed after the run's end too.")
    stacks.add_argument("run", metavar="RUN", help="the run's id")


def main(options: argparse.Namespace) -> int:
    from .._launch import stacks
    from .._display.terminal_text import printable

    report = stacks.stall_report(options.run)
    if report is not None:
        print(printable(report, keep="\t\n"))
    try:
        print(printable(str(stacks.of_run(options.run))))  # a rank's log: its escape sequences stay there
    except StacksError as error:
        print(f"fanrun: {printable(str(error), keep='')}", file=sys.stderr)
        return 0 if report is not None else 2
    return 0
