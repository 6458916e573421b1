"""The @distributed decorator, with the names of databricks.air.distributed and serverless_gpu."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from . import _accelerators, _errors, _payload
from ._tracking import caller as call_tracking
from ._launch import gpu_locks, preflight, program, run, spares
from ._launch.paths import RunPaths
from ._rank import contract
from .backends import local as local_backend
from .backends.rank_env import RANK_DEFAULTS
from ._accelerators import AcceleratorRequest

if TYPE_CHECKING:
    from ._runs.run import Run

DEFAULT_TIMEOUT = 3 * 60 * 60  # seconds
_UNSET: Any = object()
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Options:
    num_accelerators: int | None
    accelerator: AcceleratorRequest | None
    timeout: float | None
    experiment_name: str | None = None
    run_id: str | None = None
    tracking: bool = True
    # Neither a run nor MLflow variables: the ranks' MLflow is the caller's, as configured (what
    # Spark's TorchDistributor does, which fanrun.TorchDistributor follows).
    leave_mlflow_alone: bool = False
    # Machines (None: this one), where the ranks run (None: Ray when connected and nodes is
    # given, else this machine), and how long a cluster may take to fit the call.
    nodes: int | None = None
    backend: str | None = None
    placement_timeout: float = 60.0
    # Ranks from spares started ahead (_launch/spares.py): None follows FANRUN_WARM and fanrun.warmup().
    warm: bool | None = None
    # The ranks stay alive between the calls of the function (_launch/spares.py, KeptRanks).
    keep_alive: bool = False
    # .distributed() returns a fanrun.Run at once; the call goes on in a process of its own (_runs/).
    detach: bool = False
    # A failed attempt starts every rank again, this many times at most.
    max_restarts: int = 0
    # The MLflow run's name (a workload's mlflow_run_name); None: the function's name and a random part.
    run_name: str | None = None


class DistributedFunction(Generic[R]):
    """A function that runs in-process when called, and on every rank with .distributed()."""

    def __init__(self, fn: Callable[..., R], options: Options) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._options = options
        self._kept = spares.KeptRanks() if options.keep_alive else None

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self._fn(*args, **kwargs)

    def distributed(self, *args: Any, **kwargs: Any) -> list[R] | Run:
        """Runs the function once per rank with these arguments; returns every rank's value, in
        rank order (with detach=True, a fanrun.Run at once, whose .result() gives them)."""
        __tracebackhide__ = True  # IPython leaves this frame out of the tracebacks it shows
        try:
            return self._run(args, kwargs)
        except BaseException as error:
            if not _errors.raised_for_the_caller(error):
                raise
            # Shown from the caller's own line: fanrun's frames in between say nothing to them.
            raise error.with_traceback(None)  # noqa: B904 (the cause, a rank's traceback, stays)

    def _run(self, args: tuple, kwargs: dict) -> list[R] | Run:
        options = self._options
        plan, inventory = plan_for(options)
        # Before the MLflow run starts: a call that cannot start leaves no trace.
        preflight.preflight(plan)
        payload = _payload.serialize_call(self._fn, args, kwargs)
        name = getattr(self._fn, "__name__", "function")
        if options.detach:
            from ._runs import run as detached

            return detached.start(name, payload, options)
        return run_call(payload, name, options, plan, inventory, kept=self._kept)

    def __repr__(self) -> str:
        return f"<fanrun.distributed {getattr(self._fn, '__qualname__', self._fn)!r}>"


def plan_for(options: Options) -> tuple[_accelerators.Plan, _accelerators.Inventory | None]:
    """The call's plan, checked against the machine (or the cluster), and this machine's inventory."""
    if _backend_for(options) == "ray":
        from .backends import ray as ray_backend

        if options.keep_alive:
            raise ValueError("keep_alive=True keeps the ranks of this machine alive between calls; a call through "
                             "Ray starts its ranks afresh: drop keep_alive=True, or call without Ray")
        plan = ray_backend.plan(options.num_accelerators, options.accelerator, options.nodes or 1, options.placement_timeout)
        return plan, None
    inventory = _accelerators.detect()
    return _accelerators.plan_run(options.num_accelerators, options.accelerator, inventory), inventory


def run_call(payload: bytes | None, name: str, options: Options, plan: _accelerators.Plan,
             inventory: _accelerators.Inventory | None, *, rank_program: program.RankProgram | None = None,
             env: Mapping[str, str] | None = None, kept: spares.KeptRanks | None = None,
             on_paths: Callable[[RunPaths], None] | None = None) -> list:
    """Runs a serialized call (or, without one, `rank_program`: a script, a module, a program) on
    every rank of `plan`, tracked as `options` say, with `env` added to the ranks' environment;
    returns the ranks' values or raises the root cause. A failed attempt starts every rank again,
    up to options.max_restarts times. `on_paths` learns each attempt's run directory."""
    call = _Call(payload, rank_program or program.RankProgram.function(), name, dict(env or {}), kept, on_paths)
    warm = spares.warm(options.warm)
    restarts_warm = options.max_restarts > 0 and plan.backend == "local" and call.rank_program.python
    if restarts_warm:
        # A restart takes spares whose imports are done: they start now, while the first attempt runs.
        spares.POOL.fill_soon(plan.world_size, local_backend.KEEPER, RANK_DEFAULTS)
    try:
        for attempt in range(options.max_restarts + 1):
            try:
                return _attempt(call, options, plan, inventory, attempt, warm=warm or (restarts_warm and attempt > 0))
            except Exception as error:  # an interrupt is never retried
                if attempt == options.max_restarts:
                    raise
                first_line = (str(error).splitlines() or [""])[0]
                print(f"fanrun: attempt {attempt + 1} of {options.max_restarts + 1} failed ({type(error).__name__}: "
                      f"{first_line}); starting every rank again", file=sys.stderr, flush=True)
        raise AssertionError("unreachable")
    finally:
        if restarts_warm and not warm:
            spares.POOL.drop()  # started for restarts alone: they do not outlive the call


@dataclasses.dataclass(frozen=True)
class _Call:
    payload: bytes | None
    rank_program: program.RankProgram
    name: str
    env: dict[str, str]
    kept: spares.KeptRanks | None
    on_paths: Callable[[RunPaths], None] | None


def _attempt(call: _Call, options: Options, plan: _accelerators.Plan, inventory: _accelerators.Inventory | None,
             attempt: int, *, warm: bool) -> list:
    # The GPUs the ranks get, in rank order: the ones the run's system metrics describe. (A
    # cluster's GPUs are the nodes' own: this machine samples none of them.) They are this call's
    # alone while it runs: a call that holds them already goes first.
    gpus = inventory.visible[: plan.world_size] if inventory and plan.use_gpus else ()
    with gpu_locks.hold(gpus, holder=repr(call.name), on_busy=_say):
        # The MLflow run starts once the GPUs are free, and ends with the call's outcome.
        gpu_indices = [gpu.nvml_index for gpu in gpus]
        with call_tracking.track(function_name=call.name, plan=plan, gpu_indices=gpu_indices, options=options) as tracked:
            # One run directory, for the launcher and for tracking, which uploads its logs.
            with RunPaths.create(call.name) as paths:
                tracked.paths = paths
                if call.on_paths is not None:
                    call.on_paths(paths)
                restarts = {contract.ENV_RESTART_COUNT: str(attempt), contract.ENV_MAX_RESTARTS: str(options.max_restarts)}
                return run.run(
                    name=call.name,
                    plan=plan,
                    program=call.rank_program,
                    timeout=options.timeout,
                    payload=call.payload,
                    extra_env={**call.env, **tracked.rank_env, **restarts},
                    paths=paths,
                    warm=warm,
                    keep=call.kept,
                )


def _say(text: str) -> None:
    print(f"fanrun: {text}", file=sys.stderr, flush=True)


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
    warm: bool | None = None,
    keep_alive: bool = False,
    detach: bool = False,
    max_restarts: int = 0,
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

    ``warm=True`` takes the ranks from spare interpreters started ahead, with torch and the
    like already imported, and leaves as many for the next call; ``warm=False`` starts them
    fresh. The default follows ``FANRUN_WARM`` (1 or 0), else whether ``fanrun.warmup()``
    was called.

    ``keep_alive=True`` keeps the rank processes alive between the calls of this function, with
    the modules they imported and their CUDA context: each call still gets its own arguments,
    results and a fresh random seed. A failed call ends them; so do 10 idle minutes, the end of
    this process, and ``fanrun.cooldown()``.

    ``max_restarts=N``: when an attempt fails (a rank raised, was killed, or timed out), every
    rank starts again, N times at most; each attempt's ranks see ``FANRUN_RESTART_COUNT`` (and
    torchrun's ``TORCHELASTIC_RESTART_COUNT``), so that they can resume from a checkpoint.

    ``detach=True`` makes ``.distributed()`` return a ``fanrun.Run`` at once: the call runs in a
    process of its own, which goes on when this one ends. ``fanrun.attach(run_id)`` finds it again
    from any process of the same user, and ``fanrun list`` shows it.
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
        **_check_tracking(experiment_name, run_id, tracking),
        **_check_cluster(nodes, backend, placement_timeout, num_accelerators),
        warm=warm,
        keep_alive=keep_alive,
        detach=detach,
        max_restarts=_check_restarts(max_restarts),
    )
    if keep_alive and (options.backend == "ray" or (options.nodes or 1) > 1):
        raise ValueError("keep_alive=True keeps the ranks of this machine alive between calls; ranks on a Ray "
                         "cluster start afresh each call: drop keep_alive=True, or nodes= and backend='ray'")
    if detach and keep_alive:
        raise ValueError("detach=True runs each call in a process of its own, which cannot keep this process's ranks "
                         "alive: drop keep_alive=True or detach=True")
    if detach and (options.backend == "ray" or (options.nodes or 1) > 1):
        raise ValueError("detach=True runs on this machine; a detached call on a Ray cluster is not supported yet: "
                         "drop detach=True, or nodes= and backend='ray'")

    def decorate(fn: Callable[..., R]) -> DistributedFunction[R]:
        if not callable(fn):
            raise TypeError(f"@distributed decorates a function, not a {type(fn).__name__}")
        call_tracking.start_agent_early(options)
        return DistributedFunction(fn, options)

    return decorate


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


BACKENDS = ("local", "ray")


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
        raise ValueError(f"backend must be None, 'local' or 'ray', not {backend!r}")
    if backend == "local" and nodes not in (None, 1):
        raise ValueError(
            f"nodes={nodes} spreads the ranks over {nodes} machines, which takes Ray; backend='local' runs on "
            f"this machine only: drop one of them"
        )
    if isinstance(placement_timeout, bool) or not isinstance(placement_timeout, numbers.Real) or not placement_timeout > 0:
        raise ValueError(f"placement_timeout must be a positive number of seconds, not {placement_timeout!r}")
    return {"nodes": None if nodes is None else int(nodes), "backend": backend, "placement_timeout": float(placement_timeout)}


def _backend_for(options: Options) -> str:
    """Where this call runs: Ray when asked, or when connected and nodes is given; else here."""
    from .backends.ray.connect import is_connected

    if options.backend is not None:
        return options.backend
    if options.nodes is None:
        return "local"
    if is_connected():
        return "ray"
    if options.nodes == 1:
        return "local"
    raise ValueError(
        f"nodes={options.nodes} spreads the ranks over {options.nodes} machines of a Ray cluster, and this "
        f"process is connected to none: call fanrun.ray_init() first (or pass backend='ray', which does)"
    )
