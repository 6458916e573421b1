"""Tracking as the call path (_launch/call.py) plugs it in: one context around the whole call, one
around each attempt, the run that holds the call's goodput ledger, a cluster's health verdicts,
and the GPU samples the live panel shows. The rest of _tracking stays behind these five."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .._spec.spec import CallSpec
from . import caller, system_metrics


@contextlib.contextmanager
def call(spec: CallSpec) -> Iterator[caller.Submission | None]:
    """The MLflow run of a call that may restart, the parent of each attempt's; None without one."""
    with caller.track_submission(function_name=spec.name, plan=spec.plan, options=spec.options) as submission:
        yield submission


@contextlib.contextmanager
def attempt(spec: CallSpec, submission: caller.Submission | None, gpu_indices: list[int],
            health: tuple[dict[str, str], dict[str, float]] = ({}, {})) -> Iterator[caller.TrackedCall]:
    """One attempt's MLflow run: what its ranks need (rank_env), and the attempt's directory once
    it is made (.use_directory(paths)), where the ranks' step times are read while they run and
    from which their logs are uploaded. `health`: the GPU health gate's parameters and metrics."""
    with caller.track(function_name=spec.name, plan=spec.plan, gpu_indices=gpu_indices, options=spec.options,
                      submission=submission, health=health) as tracked:
        yield tracked


def holds_ledger(run: caller.Submission | caller.TrackedCall | None, ledger) -> None:
    """The call's run (a submission's, the parent of its attempts', or else its one attempt's)
    logs the call's goodput ledger (_launch/goodput.py) as it ends, closed at that moment."""
    if run is not None:
        run.final_metrics = lambda: ledger.close().metrics()


def node_health(run: caller.TrackedCall, params: dict[str, str]) -> None:
    """The health gate's verdicts that a cluster's nodes gave as its ranks started: the attempt's
    run logs them as it ends, as a local call's run logs its own gate's from its start."""
    run.final_params.update(params)


def gpu_sampler(nvml_indices: list[int]) -> Callable[[], Callable | None] | None:
    """What the live panel shows of each rank's GPU: opens NVML's utilisation and memory samples
    in this process, where a panel shows; None without GPUs."""
    if not nvml_indices:
        return None

    def open_sample():
        reader = system_metrics.GpuReader.open(nvml_indices)
        return reader.per_gpu if reader is not None else None

    return open_sample
