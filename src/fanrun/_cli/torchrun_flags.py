"""torchrun's flags on `fanrun run`: those that make sense on one machine are accepted, the
others are refused with what to use instead, so that a torchrun command line moves over as it is."""

from __future__ import annotations

import argparse
import os

# Flags fanrun accepts and has nothing to do for: its own way already does what they ask.
_NO_OPS = {
    "--standalone": "a rendezvous on this machine, chosen by the launcher: fanrun always does that",
    "--run-path": "runpy.run_path in each rank: how fanrun runs scripts",
}
# Flags with a value fanrun accepts only where it describes what fanrun does anyway.
_VALUES = ("nnodes", "node_rank", "start_method", "monitor_interval", "role",
           "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf")
# Flags fanrun refuses, each with what to do instead.
_REFUSED = {
    "--master-addr": "fanrun binds the rendezvous to 127.0.0.1 and sets MASTER_ADDR in every rank; drop --master-addr",
    "--master-port": "fanrun picks and holds a free port for each run (MASTER_PORT in every rank), so two runs never "
                     "collide; drop --master-port",
    "--local-addr": "a single-machine run uses 127.0.0.1; drop --local-addr",
    "--log-dir": "every rank's full log is kept in the run's directory under ~/.cache/fanrun/runs (FANRUN_RUNS_DIR "
                 "moves it); drop --log-dir",
    "--redirects": "every rank's output is shown live, labelled [rankN]: , and kept whole in its log; drop --redirects",
    "--tee": "every rank's output is shown live, labelled [rankN]: , and kept whole in its log; drop --tee",
    "--local-ranks-filter": "every rank's output is shown, labelled [rankN]: ; filter it with grep '^\\[rank0\\]'",
    "--event-log-handler": "fanrun has no elastic event log; drop --event-log-handler",
    "--logs-specs": "every rank's log is kept in the run's directory; drop --logs-specs",
    "--numa-binding": "fanrun does not bind ranks to NUMA nodes; bind inside the script (os.sched_setaffinity)",
    "--signals-to-handle": "fanrun stops every rank on SIGINT and SIGTERM; drop --signals-to-handle",
    "--duplicate-stdout-filters": "every rank's output is shown live and kept in its log; drop it",
    "--duplicate-stderr-filters": "every rank's output is shown live and kept in its log; drop it",
    "--virtual-local-rank": "each rank sees the GPU it was given; drop --virtual-local-rank",
}
_LOOPBACK_HOSTS = {"", "localhost", "127.0.0.1", "::1", "[::1]"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's spellings, with dashes or underscores, hidden from fanrun's own help but for
    --max-restarts, which fanrun does as torchrun does."""
    hidden = argparse.SUPPRESS
    # What it is to torchrun, and to @distributed(max_restarts=).
    parser.add_argument(*_spellings("--max-restarts"), dest="max_restarts", default="0", metavar="N",
                        help="when a rank fails, start every rank again, N times at most (default: 0); each attempt's "
                        "ranks see TORCHELASTIC_RESTART_COUNT and FANRUN_RESTART_COUNT")
    for flag in _NO_OPS:
        parser.add_argument(*_spellings(flag), action="store_true", help=hidden)
    for dest in _VALUES:
        parser.add_argument(*_spellings("--" + dest.replace("_", "-")), dest=dest, default=None, help=hidden)
    for flag in _REFUSED:
        short = {"--redirects": ["-r"], "--tee": ["-t"]}.get(flag, [])
        parser.add_argument(*_spellings(flag), *short, dest=_dest(flag), default=None, help=hidden)


def check_flags(options: argparse.Namespace) -> None:
    """Raises ValueError for a torchrun flag whose value fanrun cannot honour, naming what to do."""
    for flag, why in _REFUSED.items():
        if getattr(options, _dest(flag)) is not None:
            raise ValueError(f"{flag} is torchrun's: {why}")
    if options.nnodes is not None and options.nnodes.strip() not in ("1", "1:1"):
        raise ValueError(f"--nnodes {options.nnodes}: fanrun run starts the ranks of one machine, or with --nodes M "
                         f"those of M nodes of a Slurm allocation; run it with --nnodes 1, or --nodes")
    if options.node_rank is not None and options.node_rank.strip() != "0":
        raise ValueError(f"--node-rank {options.node_rank}: fanrun run is one node, rank 0; drop --node-rank")
    if options.start_method is not None and options.start_method.strip() != "spawn":
        raise ValueError(f"--start-method {options.start_method}: every rank is a fresh interpreter (spawn), never a "
                         f"fork of the launcher; drop --start-method")
    if options.rdzv_backend is not None and options.rdzv_backend.strip() not in ("c10d", "static"):
        raise ValueError(f"--rdzv-backend {options.rdzv_backend}: fanrun hosts torch's TCP store (c10d) itself; "
                         f"drop --rdzv-backend")
    if options.rdzv_endpoint is not None:
        host = options.rdzv_endpoint.strip().rsplit(":", 1)[0] if ":" in options.rdzv_endpoint else options.rdzv_endpoint
        if host.strip() not in _LOOPBACK_HOSTS:
            raise ValueError(f"--rdzv-endpoint {options.rdzv_endpoint}: fanrun run's rendezvous is on 127.0.0.1, "
                             f"on a port it holds; drop --rdzv-endpoint")


def max_restarts(options: argparse.Namespace) -> int:
    """torchrun's --max-restarts: how many times every rank starts again after a failure (0 by default)."""
    try:
        restarts = int(options.max_restarts.strip())
    except ValueError:
        restarts = -1
    if restarts < 0:
        raise ValueError(f"--max-restarts must be a whole number of restarts, 0 or more, not {options.max_restarts!r}")
    return restarts


def nproc_per_node(value: str) -> tuple[int | None, bool]:
    """torchrun's --nproc-per-node: a count, or 'gpu', 'cpu', 'auto'. Returns the count (None: one
    rank per GPU) and whether CPU processes are asked for."""
    text = value.strip().lower()
    if text == "gpu":
        return None, False
    if text == "cpu":
        return os.cpu_count() or 1, True
    if text == "auto":
        return None, False  # one per GPU, else fanrun's default CPU processes
    try:
        return int(text), False
    except ValueError:
        raise ValueError(f"-n/--nproc-per-node must be a number of ranks, or gpu, cpu or auto; not {value!r}") from None


def _spellings(flag: str) -> list[str]:
    underscored = "--" + flag[2:].replace("-", "_")
    return [flag] if underscored == flag else [flag, underscored]


def _dest(flag: str) -> str:
    return "torchrun_" + flag[2:].replace("-", "_")
