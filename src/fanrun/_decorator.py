"""The @distributed decorator, with the names of databricks.air.distributed and serverless_gpu."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from typing import Any, Callable, Generic, TypeVar

from . import _accelerators, _launcher, _payload
from ._accelerators import AcceleratorRequest

DEFAULT_TIMEOUT = 3 * 60 * 60  # seconds
_UNSET: Any = object()
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Options:
    num_accelerators: int | None
    accelerator: AcceleratorRequest | None
    timeout: float | None


class DistributedFunction(Generic[R]):
    """A function that runs in-process when called, and on every rank with .distributed()."""

    def __init__(self, fn: Callable[..., R], options: Options) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._options = options

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self._fn(*args, **kwargs)

    def distributed(self, *args: Any, **kwargs: Any) -> list[R]:
        """Runs the function once per rank with these arguments; returns every rank's value, in rank order."""
        options = self._options
        plan = _accelerators.plan_run(options.num_accelerators, options.accelerator, _accelerators.detect())
        payload = _payload.serialize_call(self._fn, args, kwargs)
        name = getattr(self._fn, "__name__", "function")
        return _launcher.run(
            name=name,
            plan=plan,
            program=_launcher.RankProgram.function(),
            timeout=options.timeout,
            payload=payload,
        )

    def __repr__(self) -> str:
        return f"<fanrun.distributed {getattr(self._fn, '__qualname__', self._fn)!r}>"


def distributed(
    num_accelerators: int | Callable | None = None,
    accelerator_type: Any = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    *,
    gpus: Any = _UNSET,
    gpu_type: Any = _UNSET,
):
    """Decorates a function so that `fn.distributed(*args, **kwargs)` runs it on every
    accelerator of this machine (CPU processes where there is none).

    Usable as ``@distributed``, ``@distributed()`` and ``@distributed(num_accelerators=2,
    accelerator_type="GPU_8xH100", timeout=600)``. ``gpus`` and ``gpu_type`` are the legacy
    names of serverless_gpu.
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, numbers.Number):
        return distributed()(num_accelerators)  # bare @distributed
    if gpus is not _UNSET:
        if num_accelerators is not None:
            raise TypeError("pass num_accelerators or its legacy name gpus, not both")
        warnings.warn("gpus= is a legacy name from serverless_gpu; use num_accelerators=", FutureWarning, stacklevel=2)
        num_accelerators = gpus
    if gpu_type is not _UNSET:
        if accelerator_type is not None:
            raise TypeError("pass accelerator_type or its legacy name gpu_type, not both")
        warnings.warn("gpu_type= is a legacy name from serverless_gpu; use accelerator_type=", FutureWarning, stacklevel=2)
        accelerator_type = gpu_type
    options = Options(
        num_accelerators=_check_count(num_accelerators),
        accelerator=_accelerators.parse_accelerator_type(accelerator_type),
        timeout=_check_timeout(timeout),
    )

    def decorate(fn: Callable[..., R]) -> DistributedFunction[R]:
        if not callable(fn):
            raise TypeError(f"@distributed decorates a function, not a {type(fn).__name__}")
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


def _check_timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds or None, not {type(value).__name__}")
    if not value > 0:  # NaN included
        raise ValueError(f"timeout must be positive (seconds), or None for no timeout; got {value!r}")
    return None if math.isinf(value) else float(value)
