"""The @distributed decorator, with the names of databricks.air.distributed and serverless_gpu."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import warnings
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from . import _accelerators, _errors
from ._caller_frames import raised_from_the_caller
from ._launch import call
from ._spec import payload as _payload
from ._spec.display import check_display
from ._spec.health import DEFAULT_HEALTH, check_health
from ._spec.program import RankProgram
from ._spec.spec import DEFAULT_STALL_WARNING_S, DEFAULT_TIMEOUT_S, RESTARTS, Options
from ._spec.stall import check_stall
from ._tracking import caller as call_tracking
from .backends.local import spares

if TYPE_CHECKING:
    from ._detached.run import Run

DEFAULT_TIMEOUT = DEFAULT_TIMEOUT_S  # seconds
_UNSET: Any = object()
R = TypeVar("R")


class DistributedFunction(Generic[R]):
    """A function that runs in-process when called, and on every rank with .distributed()."""

    def __init__(self, fn: Callable[..., R], options: Options) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._options = options
        self._kept = spares.KeptRanks() if options.keep_alive else None

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self._fn(*args, **kwargs)

    @raised_from_the_caller
    def distributed(self, *args: Any, **kwargs: Any) -> list[R] | Run:
        """Runs the function once per rank with these arguments; returns every rank's value, in
        rank order (with detach=True, a fanrun.Run at once, whose .result() gives them)."""
        return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> list[R] | Run:
        _check_arguments(self._fn, args, kwargs)
        # Planned before the MLflow run starts: a call that cannot start leaves no trace.
        spec = call.plan(getattr(self._fn, "__name__", "function"), self._options, RankProgram.function())
        spec = dataclasses.replace(spec, payload=_payload.serialize_call(self._fn, args, kwargs))
        if spec.options.detach:
            from ._detached import run as detached

            return detached.start(spec)
        return call.run(spec, kept=self._kept)

    def __repr__(self) -> str:
        return f"<fanrun.distributed {getattr(self._fn, '__qualname__', self._fn)!r}>"


def distributed(
    num_accelerators: int | Callable | None = None,
    accelerator_type: Any = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    *,
    experiment_name: str | None = None,
    run_id: str | None = None,
    tracking: bool = True,
    gpus: Any = _UNSET,
    gpu_type: Any = _UNSET,
    remote: bool = False,
    nodes: int | None = None,
    backend: str | None = None,
    placement_timeout: float = 60.0,
    slurm: dict | None = None,
    warm: bool | None = None,
    keep_alive: bool = False,
    detach: bool = False,
    max_restarts: int = 0,
    restart: str = "keep",
    display: str | None = None,
    stall_warning: float | None = DEFAULT_STALL_WARNING_S,
    stall_timeout: float | None = None,
    on_stall: Any = "report",
    health: str | None = DEFAULT_HEALTH,
    exclude_unhealthy: bool = False,
):
    """Decorates a function so that `fn.distributed(*args, **kwargs)` runs it on every
    accelerator of this machine (CPU processes where there is none).

    Usable as ``@distributed``, ``@distributed()`` and ``@distributed(num_accelerators=2,
    accelerator_type="GPU_8xH100", timeout=600)``. ``gpus`` and ``gpu_type`` are the legacy
    names of serverless_gpu.

    Each call is an MLflow run that every rank logs to (a child of the run active in the
    caller, if any): ``experiment_name`` chooses its experiment, ``run_id`` resumes that run
    instead of starting one, ``tracking=False`` turns all of it off.

    ``nodes=M`` spreads the ``num_accelerators`` ranks (a multiple of M) over M machines of the
    Ray cluster this process is connected to (fanrun.ray_init()), ``num_accelerators / M`` on
    each. ``backend="ray"`` runs through Ray even on one node, ``backend="local"`` never does.
    A cluster that cannot fit the call within ``placement_timeout`` seconds is an error.
    ``backend="slurm"`` spreads them over ``nodes`` nodes of a Slurm allocation: the one this process
    runs in (salloc, sbatch), or, from a login node, one that srun asks Slurm for with the srun
    options in ``slurm`` (``{"partition": "gpu", "time": "1:00:00", "gres": "gpu:8"}``). Inside an
    allocation, ``nodes=M`` alone goes to Slurm. The call's run directory must be on storage every
    node shares (``FANRUN_RUNS_DIR``; docs/slurm.md).

    ``warm=True`` takes the ranks from spare interpreters started ahead, with torch and the
    like already imported, and leaves as many for the next call; ``warm=False`` starts them
    fresh. The default follows ``FANRUN_WARM`` (1 or 0), else whether ``fanrun.warmup()``
    was called, else whether this machine has 4 cores for each rank (a GPU host: warm; a
    small machine: cold).

    ``keep_alive=True`` keeps the rank processes alive between the calls of this function, with
    the modules they imported and their CUDA context: each call still gets its own arguments,
    results and a fresh random seed. A failed call ends them; so do 10 idle minutes, the end of
    this process, and ``fanrun.cooldown()``.

    ``max_restarts=N``: when an attempt fails (a rank raised, was killed, or timed out), the call
    starts again, N times at most; each attempt's ranks see ``FANRUN_RESTART_COUNT`` (and
    torchrun's ``TORCHELASTIC_RESTART_COUNT``), so that they can resume from a checkpoint. With
    ``restart="keep"`` (the default) the ranks that did not fail abandon the attempt (their process
    group aborted) and are called again in their processes, with their imports and CUDA context;
    the failed rank, and any left unfit (a CUDA error, threads it cannot end), is replaced by a new
    process (docs/restarts.md). ``restart="fresh"`` starts every rank in a new process.

    ``detach=True`` makes ``.distributed()`` return a ``fanrun.Run`` at once: the call runs in a
    process of its own, which goes on when this one ends. ``fanrun.attach(run_id)`` finds it again
    from any process of the same user, and ``fanrun list`` shows it.

    ``display`` chooses how the ranks' output shows while the call runs: ``"panel"``, one live
    panel with a row per rank (state, progress bar, last line), redrawn in place in a notebook
    cell or a terminal, the full logs under it; ``"logs"``, every line, labelled by rank;
    ``"quiet"``, nothing (the run's log files keep it all). The default is the panel in a
    notebook and logs elsewhere. The panel flags a rank with no output, progress or metric for
    ``stall_warning`` seconds (None: never); ``fanrun.stacks()`` or ``fanrun stacks RUN`` then
    shows where every rank is, without stopping it.

    A call that makes no progress (no optimizer step, DataLoader batch, finished collective or
    progress-bar update) for ``stall_timeout`` seconds has stalled. The default timeout is the
    larger of 60 s and 10 step times once steps are seen, and 300 s before. fanrun then gathers
    every rank's stacks, last collectives and last lines without stopping any, and names the
    culprit rank and the reason in one sentence (docs/hangs.md). ``on_stall="report"`` (the
    default) shows and keeps that report and lets the call go on; ``"abort"`` stops the call with
    ``fanrun.RankStalledError``; a function is called with the report (a ``StallReport``), and
    stops the call by raising; ``None`` watches for no stall.

    Before any rank of a GPU call starts, once the call holds its GPUs, ``health`` checks them
    (docs/health.md): ``"cheap"`` (the default, a few milliseconds) reads NVML's answers for
    uncorrectable ECC errors, memory pages or rows awaiting retirement, clocks throttled by heat
    or power, a narrow PCIe link and other processes holding memory; ``"deep"`` adds a few
    seconds of bf16 matrix products, a memory copy and an all-reduce on each GPU, judged against
    the model's figures; ``"off"`` (or None) checks nothing. An unhealthy GPU stops the call with
    ``fanrun.GpuHealthError``, naming it and why; ``exclude_unhealthy=True`` runs the call on the
    healthy GPUs instead, re-ranked, with fewer ranks.
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, numbers.Number):
        return distributed()(num_accelerators)  # bare @distributed
    if gpus is not _UNSET:
        if num_accelerators is not None:
            raise TypeError("pass num_accelerators or its legacy name gpus, not both")
        warnings.warn("gpus= is a legacy name from serverless_gpu; use num_accelerators=", FutureWarning, stacklevel=2)
        num_accelerators = gpus
    if not isinstance(remote, bool):
        raise TypeError(f"remote must be True or False, not {type(remote).__name__}")
    if warm is not None and not isinstance(warm, bool):
        raise TypeError(f"warm must be True, False or None, not {type(warm).__name__} ({warm!r})")
    for label, value in (("keep_alive", keep_alive), ("detach", detach)):
        if not isinstance(value, bool):
            raise TypeError(f"{label} must be True or False, not {type(value).__name__} ({value!r})")

    if remote:
        # serverless_gpu's remote=True sends the call to a managed GPU pool; fanrun has none.
        raise ValueError(
            "remote=True runs on Databricks' managed GPU pool; fanrun runs on this machine's "
            "accelerators: drop remote=True (remote=False, the default, is accepted)"
        )
    if gpu_type is not _UNSET:
        if accelerator_type is not None:
            raise TypeError("pass accelerator_type or its legacy name gpu_type, not both")
        warnings.warn("gpu_type= is a legacy name from serverless_gpu; use accelerator_type=", FutureWarning, stacklevel=2)
        accelerator_type = gpu_type
    options = Options(
        num_accelerators=_check_count(num_accelerators),
        accelerator=_accelerators.parse_accelerator_type(accelerator_type),
        timeout=_check_timeout(timeout),
        gpus_required=None if gpus is _UNSET else (f"gpus={gpus!r}", f"pass num_accelerators={gpus!r} instead"),
        **_check_tracking(experiment_name, run_id, tracking),
        **_check_cluster(nodes, backend, placement_timeout, num_accelerators),
        slurm=_check_slurm(slurm, backend),
        warm=warm,
        keep_alive=keep_alive,
        detach=detach,
        max_restarts=_check_restarts(max_restarts),
        restart=_check_restart(restart),
        **check_display(display, stall_warning),
        **check_stall(stall_timeout, on_stall),
        **check_health(health, exclude_unhealthy),
    )
    if keep_alive and (options.backend in CLUSTER_BACKENDS or (options.nodes or 1) > 1):
        raise ValueError("keep_alive=True keeps the ranks of this machine alive between calls; ranks on a cluster "
                         "(Ray, Slurm) start afresh each call: drop keep_alive=True, or nodes= and backend=")
    if detach and callable(on_stall):
        raise ValueError("on_stall= a function runs in the calling process, and a detached run goes on in a process "
                         "of its own: pass on_stall='report' or 'abort' with detach=True")
    if detach and keep_alive:
        raise ValueError("detach=True runs each call in a process of its own, which cannot keep this process's ranks "
                         "alive: drop keep_alive=True or detach=True")
    if detach and options.backend != "slurm" and (options.backend == "ray" or (options.nodes or 1) > 1):
        raise ValueError("detach=True runs its caller on this machine: with backend='slurm', srun starts its ranks on "
                         "Slurm's nodes; a run over a Ray cluster's nodes outlives its caller as a Ray job (`fanrun "
                         "submit` a workload file with compute.nodes, docs/detached.md). Here, drop detach=True, or "
                         "nodes=, or pass backend='slurm'")

    def decorate(fn: Callable[..., R]) -> DistributedFunction[R]:
        if not callable(fn):
            raise TypeError(f"@distributed decorates a function, not a {type(fn).__name__}")
        call_tracking.start_agent_early(options)
        return DistributedFunction(fn, options)

    return decorate


def _check_arguments(fn: Callable, args: tuple, kwargs: dict) -> None:
    """The arguments against the function's signature, here: a rank would raise the same TypeError
    only once every rank has started."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature to read: the ranks will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        raise _errors.CallArgumentsError(
            f"{name}{signature} cannot take the arguments given to .distributed(): {error}. No rank was started"
        ) from None


def _check_count(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"num_accelerators must be an int, not {type(value).__name__} ({value!r})")
    if value < 1:
        machine = _accelerators.detect().describe()
        raise ValueError(f"num_accelerators must be at least 1, not {value}; this machine has {machine}")
    return int(value)


def _check_restarts(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"max_restarts must be a whole number of restarts, 0 or more, not {value!r}")
    return int(value)


def _check_restart(value: Any) -> str:
    if value not in RESTARTS:
        raise ValueError(f"restart must be one of {', '.join(map(repr, RESTARTS))}: \"keep\" calls the function "
                         f"again in the processes of the ranks that did not fail, \"fresh\" starts every rank anew; "
                         f"not {value!r}")
    return value


def _check_timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds or None, not {type(value).__name__}")
    if not value > 0:  # NaN included
        raise ValueError(f"timeout must be positive (seconds), or None for no timeout; got {value!r}")
    return None if math.isinf(value) else float(value)


def _check_tracking(experiment_name: Any, run_id: Any, tracking: Any) -> dict[str, Any]:
    if not isinstance(tracking, bool):
        raise TypeError(f"tracking must be True or False, not {type(tracking).__name__} ({tracking!r})")
    for label, value in (("experiment_name", experiment_name), ("run_id", run_id)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(f"{label} must be a string or None, not {type(value).__name__} ({value!r})")
        if not value.strip():
            raise ValueError(f"{label} must be a non-empty string, not {value!r}")
        if label == "run_id" and value != value.strip():
            raise ValueError(f"run_id must be a run's id without surrounding spaces, not {value!r}")
    if not tracking and (experiment_name is not None or run_id is not None):
        given = "experiment_name" if experiment_name is not None else "run_id"
        raise ValueError(f"{given}= needs MLflow tracking, but tracking=False turns it off; drop one of them")
    if experiment_name is not None and run_id is not None:
        raise ValueError(
            "run_id= resumes a run in the experiment it already belongs to, so experiment_name= cannot "
            "apply; pass one of them, not both"
        )
    return {"experiment_name": experiment_name, "run_id": run_id, "tracking": tracking}


BACKENDS = ("local", "ray", "slurm")
CLUSTER_BACKENDS = ("ray", "slurm")


def _check_slurm(slurm: Any, backend: Any) -> dict[str, str] | None:
    if slurm is None:
        return None
    if backend not in (None, "slurm"):
        raise ValueError(f"slurm= gives srun's options, and backend={backend!r} runs without Slurm: drop slurm=, "
                         f"or pass backend='slurm'")
    from .backends.slurm.allocation import check_options

    return check_options(slurm)


def _check_cluster(nodes: Any, backend: Any, placement_timeout: Any, num_accelerators: Any) -> dict[str, Any]:
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, numbers.Integral):
            raise TypeError(f"nodes must be an int (the number of machines) or None, not {type(nodes).__name__}")
        if nodes < 1:
            raise ValueError(f"nodes must be at least 1, not {nodes}")
        if isinstance(num_accelerators, numbers.Integral) and num_accelerators % nodes:
            raise ValueError(
                f"num_accelerators={num_accelerators} is the number of ranks in all, and nodes={nodes} machines "
                f"must run the same number each: ask for a multiple of {nodes}"
            )
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'local', 'ray' or 'slurm', not {backend!r}")
    if backend == "local" and nodes not in (None, 1):
        raise ValueError(
            f"nodes={nodes} spreads the ranks over {nodes} machines, which takes Ray or Slurm; backend='local' runs on "
            f"this machine only: drop one of them"
        )
    if isinstance(placement_timeout, bool) or not isinstance(placement_timeout, numbers.Real) or not placement_timeout > 0:
        raise ValueError(f"placement_timeout must be a positive number of seconds, not {placement_timeout!r}")
    return {"nodes": None if nodes is None else int(nodes), "backend": backend, "placement_timeout": float(placement_timeout)}
