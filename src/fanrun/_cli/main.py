"""The command line: `fanrun run` (run.py), `submit` (submit.py), `list`, `logs`, `attach`, `cancel`
(runs.py), `stacks` (stacks.py), `doctor` (doctor.py) and `ui` (ui.py), one module per command, each with its parser
and its main."""

from __future__ import annotations

import argparse
import signal
import sys

from .._version import __version__
from . import doctor, run, runs, stacks, submit, ui

_COMMANDS = {"run": run, "doctor": doctor, "submit": submit, "stacks": stacks, "ui": ui, **{name: runs for name in runs.COMMANDS}}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fanrun", description="Run a program on every accelerator of this machine.")
    parser.add_argument("--version", action="version", version=f"fanrun {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (run, ui, stacks, submit, runs, doctor):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    # A scheduler's SIGTERM stops the ranks the same way as Ctrl+C does.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    return _COMMANDS[options.command].main(options)


def _raise_system_exit(signo: int, frame: object) -> None:
    raise SystemExit(128 + signo)


if __name__ == "__main__":
    sys.exit(main())
