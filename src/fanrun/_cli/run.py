"""`fanrun run`: a script, a module or a native program once per rank, like torchrun, through the
one call path."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .. import _accelerators
from .._errors import RankFailedError, RemoteTraceback, RunTimeoutError
from .._launch import call
from .._spec.program import RankProgram
from .._spec.spec import DEFAULT_TIMEOUT_S, Options
from . import run_flags, runs, torchrun_flags


def add_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="run a script, a module or a program once per rank",
        description="Runs SCRIPT (or -m MODULE, or a program with --no-python) once per rank, "
        "with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). "
        "torchrun's own flags are understood: --nproc-per-node is -n, --standalone is what fanrun always does, "
        "and a flag that does not apply on one machine is refused with what to use instead.",
    )
    run.add_argument("-n", "--num-accelerators", "--nproc-per-node", "--nproc_per_node", default=None, metavar="N",
                     help="ranks to start: a number, or gpu (one per GPU), cpu (one per core), auto "
                     "(default: every GPU, or %d CPU processes)" % _accelerators.DEFAULT_CPU_RANKS)
    run.add_argument("--accelerator-type", default=None, metavar="TYPE",
                     help="the machine type to expect, such as GPU_8xH100, or CPU to run CPU processes")
    run.add_argument("--nodes", type=int, default=None, metavar="M",
                     help="inside a Slurm allocation (salloc, sbatch): run on M of its nodes, -n ranks on each "
                     "(default: each node's GPUs, or %d CPU processes)" % _accelerators.DEFAULT_CPU_RANKS)
    run.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                     help="seconds before every rank is stopped (default: 3 hours; 0: none)")
    kind = run.add_mutually_exclusive_group()
    kind.add_argument("-m", "--module", action="store_true", help="run TARGET as a module, like python -m")
    kind.add_argument("--no-python", "--no_python", action="store_true", help="run TARGET as a program, not a Python script")
    run.add_argument("target", metavar="TARGET", help="script.py, a module name with -m, or a program with --no-python")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to every rank")
    torchrun_flags.add_flags(run)
    run_flags.add_flags(run)


def _slurm_nodes(options: argparse.Namespace) -> dict:
    """--nodes M: the call's nodes and backend, inside a Slurm allocation only."""
    if options.nodes is None or options.nodes == 1:
        return {}
    if options.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, not {options.nodes}")
    from ..backends.slurm.allocation import in_allocation

    if not in_allocation():
        raise ValueError(
            f"--nodes {options.nodes} runs on the nodes of a Slurm allocation, and this shell is in none "
            f"(SLURM_JOB_ID is not set): run `salloc --nodes={options.nodes} fanrun run --nodes {options.nodes} ...`, "
            f"or sbatch a script that runs it")
    return {"nodes": options.nodes, "backend": "slurm"}


def main(options: argparse.Namespace) -> int:
    try:
        torchrun_flags.check_flags(options)
        run_flags.check_combinations(options)
        count, cpu = (None, False) if options.num_accelerators is None else torchrun_flags.nproc_per_node(options.num_accelerators)
        if count is not None and count < 1:
            raise ValueError(f"-n must be at least 1, not {count}")
        accelerator_type = "CPU" if cpu and options.accelerator_type is None else options.accelerator_type
        cluster = _slurm_nodes(options)
        if cluster and count is not None:
            count *= options.nodes  # -n is per node, as torchrun's --nproc-per-node
        asked = Options(num_accelerators=count, accelerator=_accelerators.parse_accelerator_type(accelerator_type),
                        timeout=options.timeout if options.timeout and options.timeout > 0 else None,
                        max_restarts=torchrun_flags.max_restarts(options), detach=options.detach,
                        **run_flags.display(options), **run_flags.stall(options),
                        **run_flags.tracking(options), **run_flags.health(options), **cluster)
        if not options.no_python and not options.module and not os.path.isfile(options.target):
            raise FileNotFoundError(f"the script {options.target!r} does not exist (working directory {os.getcwd()}); "
                                    f"use -m for a module, or --no-python for a program")
        if options.no_python:
            program = RankProgram.native([options.target, *options.args])
        else:
            program = RankProgram.script(options.target, options.args, module=options.module)
        spec = call.plan(options.target.rsplit("/", 1)[-1], asked, program)
        if options.detach:
            from .._detached import run as detached

            return runs.started(detached.start(spec), watch=options.watch)
        call.run(spec)
        return 0
    except KeyboardInterrupt:
        print("fanrun: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    except SystemExit as stop:  # SIGTERM, after the ranks were stopped
        return stop.code if isinstance(stop.code, int) else 1
    except RunTimeoutError as error:
        print(f"fanrun: {error}", file=sys.stderr)
        return 124
    except RankFailedError as error:
        print(f"fanrun: {error}", file=sys.stderr)
        if error.signal_name in signal.Signals.__members__:
            return 128 + signal.Signals[error.signal_name]  # as a shell reports a command killed by a signal
        return error.exit_code if isinstance(error.exit_code, int) and error.exit_code > 0 else 1
    except Exception as error:
        # A rank's own exception, shown here once with its traceback, or bad input.
        remote = error.__cause__ if isinstance(error.__cause__, RemoteTraceback) else None
        if remote is not None:
            print(str(remote).strip(), file=sys.stderr)
        origin = "a rank failed: " if remote is not None else ""
        print(f"fanrun: {origin}{type(error).__name__}: {error}", file=sys.stderr)
        for note in getattr(error, "__notes__", []):
            print(note, file=sys.stderr)
        return 1
