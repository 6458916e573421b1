"""`fanrun ui`: MLflow's UI for the runs of tracked calls, on 127.0.0.1."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    ui = commands.add_parser(
        "ui",
        help="open the MLflow runs of tracked calls in MLflow's UI, on 127.0.0.1",
        description="Serves MLflow's UI for fanrun's own store (or --backend-store-uri) on 127.0.0.1 until Ctrl+C; "
        "meanwhile each tracked call's line links to its run there.",
    )
    ui.add_argument("--backend-store-uri", default=None, metavar="URI",
                    help="a local MLflow store to show instead of fanrun's own (see docs/tracking.md)")
    ui.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: 5000 if free)")


def main(options: argparse.Namespace) -> int:
    from .._tracking import ui

    return ui.main(options.backend_store_uri, options.port)
