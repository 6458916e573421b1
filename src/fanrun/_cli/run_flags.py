"""`fanrun run`'s flags for what the decorator's arguments ask of a function's call: how the output
shows (--display, --stall-warning), a run that goes on by itself (--detach, --watch), an MLflow
run for the ranks (--tracking, --experiment-name, --run-name), and the GPUs' health check (--health,
--exclude-unhealthy). Each combination that cannot be honoured is refused here, before anything
starts, with what to do instead."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from .._display.output import default_display
from .._spec.display import FLAGS, check_display
from .._spec.health import FLAGS as HEALTH_FLAGS, check_health
from .._spec.spec import DEFAULT_STALL_WARNING_S
from .._spec.stall import FLAGS as STALL_FLAGS, check_stall
from .._tracking.caller import enabled as tracking_enabled


def add_flags(parser: argparse.ArgumentParser) -> None:
    shown = parser.add_argument_group("output")
    shown.add_argument("--display", default=None, metavar="HOW",
                       help="how the ranks' output shows: panel, one live row per rank, redrawn in this terminal; "
                       "logs, every line, labelled [rankN]: ; quiet, nothing, while every rank's log file keeps it all "
                       "(default: $FANRUN_DISPLAY, else logs)")
    shown.add_argument("--stall-warning", default=None, metavar="SECONDS",
                       help="with --display panel: flag a rank with no output, progress or metric for this long "
                       f"(default: {DEFAULT_STALL_WARNING_S:g}; none: never)")
    stalls = parser.add_argument_group("stalls", "A run with no optimizer step, DataLoader batch, finished collective "
                                       "or progress-bar update for the stall timeout has stalled: every rank's "
                                       "stacks and last collectives are gathered without stopping it, and the "
                                       "culprit is named (`fanrun stacks RUN` shows the report).")
    stalls.add_argument("--stall-timeout", default=None, metavar="SECONDS",
                        help="the stall timeout (default: the larger of 60 s and 10 step times once steps are seen, "
                        "300 s before)")
    stalls.add_argument("--on-stall", default="report", metavar="WHAT",
                        help="report: say why, and go on; abort: stop the run with the report; off: watch for no "
                        "stall (default: report)")
    health = parser.add_argument_group("GPU health", "Before any rank of a GPU run starts, its GPUs are checked "
                                       "(docs/health.md; `fanrun doctor` checks the node alone).")
    health.add_argument("--health", default="cheap", metavar="HOW",
                        help="cheap: NVML's answers (ECC, memory repair, throttling, PCIe link, other processes); "
                        "deep: and a few seconds of work on every GPU; off: no check (default: cheap)")
    health.add_argument("--exclude-unhealthy", action="store_true",
                        help="run on the healthy GPUs, re-ranked, instead of stopping at an unhealthy one")
    detached = parser.add_argument_group("detached runs")
    detached.add_argument("--detach", action="store_true",
                          help="run in a process of its own, which goes on when this command ends; print the run's "
                          "id (fanrun attach, logs, list and cancel take it)")
    detached.add_argument("--watch", action="store_true",
                          help="with --detach: follow the run to its end, as `fanrun attach` does")
    tracking = parser.add_argument_group(
        "MLflow tracking", "Without these flags, the ranks' MLflow is left as this environment configures it, as "
        "under torchrun. With any of them, fanrun makes the run an MLflow run, active in every rank once its script "
        "imports mlflow, as a @distributed call's is: in $MLFLOW_TRACKING_URI's store, else in fanrun's own, which "
        "`fanrun ui` serves.")
    tracking.add_argument("--tracking", action="store_true",
                          help="make the MLflow run, in the experiment $MLFLOW_EXPERIMENT_NAME names, else MLflow's "
                          "default")
    tracking.add_argument("--experiment-name", default=None, metavar="NAME",
                          help="make the MLflow run in this experiment (made if need be)")
    tracking.add_argument("--run-name", default=None, metavar="NAME",
                          help="the MLflow run's name (default: the script's name and a random part)")


def check_combinations(options: argparse.Namespace) -> None:
    """Raises ValueError for flags that go together badly, naming what to do instead."""
    if options.watch and not options.detach:
        raise ValueError("--watch follows a detached run; without --detach, fanrun run shows the ranks' output "
                         "itself until they end: add --detach, or drop --watch")
    asked = display(options)
    if options.detach and asked["display"] == "panel":
        raise ValueError("--display panel redraws its rows in this terminal, which a detached run does not have: "
                         "`fanrun attach RUN` shows its output labelled by rank; drop --display panel, or --detach")
    if options.stall_warning is not None and options.detach:
        raise ValueError("--stall-warning flags a quiet rank in the live panel, which a detached run does not show: "
                         "drop --stall-warning, or --detach")
    if options.stall_warning is not None and (asked["display"] or default_display()) != "panel":
        raise ValueError("--stall-warning flags a quiet rank in the live panel, and this run shows none: add "
                         "--display panel, or drop --stall-warning")


def display(options: argparse.Namespace) -> dict[str, Any]:
    """Options' display and stall_warning, checked as the decorator's display= and stall_warning= are."""
    shown = None if options.display in (None, "none") else options.display
    stall: Any = options.stall_warning
    if stall is None:
        stall = DEFAULT_STALL_WARNING_S
    elif stall.strip().lower() == "none":
        stall = None
    else:
        try:
            stall = float(stall)
        except ValueError:
            pass  # the check names the text as it was given
    return check_display(shown, stall, FLAGS)


def stall(options: argparse.Namespace) -> dict[str, Any]:
    """Options' stall_timeout and on_stall, checked as the decorator's are."""
    timeout: Any = options.stall_timeout
    if timeout is not None:
        try:
            timeout = float(timeout)
        except ValueError:
            pass  # the check names the text as it was given
    on_stall = None if options.on_stall == "off" else options.on_stall
    return check_stall(timeout, on_stall, STALL_FLAGS)


def health(options: argparse.Namespace) -> dict[str, Any]:
    """Options' health and exclude_unhealthy, checked as the decorator's are."""
    return check_health(options.health, options.exclude_unhealthy, HEALTH_FLAGS)


def tracking(options: argparse.Namespace) -> dict[str, Any]:
    """Options' tracking: the ranks' MLflow left alone, as torchrun does, unless a flag asks for a run."""
    for flag, value in (("--experiment-name", options.experiment_name), ("--run-name", options.run_name)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag} must be a name, not {value!r}")
    if not (options.tracking or options.experiment_name is not None or options.run_name is not None):
        return {"leave_mlflow_alone": True}
    flag = "--tracking" if options.tracking else "--experiment-name" if options.experiment_name else "--run-name"
    if not tracking_enabled(True):
        raise ValueError(f"{flag} asks for an MLflow run, but FANRUN_TRACKING turns tracking off in this "
                         f"environment: unset FANRUN_TRACKING, or drop {flag}")
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError(f"{flag} asks for an MLflow run, and MLflow is not installed: pip install mlflow, "
                         f"or drop {flag}")
    return {"tracking": True, "experiment_name": options.experiment_name, "run_name": options.run_name}
