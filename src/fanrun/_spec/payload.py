"""Serializing the call once, in the caller, and naming the object that cannot be pickled."""

from __future__ import annotations

import io
import pickle
import types
import warnings
from typing import Any, Callable

import cloudpickle

from .._caller_frames import caller_stacklevel
from .._errors import PayloadSerializationError, PayloadSizeWarning

_ADVICE = (
    "Create it inside the function instead, so that each rank makes its own "
    "(for a large dataset, load it inside the function too, so that each rank reads it itself)."
)


# A call this large in pickled bytes is said, with what makes it so: each rank reads all of it.
LARGE_PAYLOAD_BYTES = 100 * 1000 * 1000
# The parts named in that warning: those of at least this share of it.
_LARGE_PART_BYTES = LARGE_PAYLOAD_BYTES // 10


def serialize_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args, kwargs))
        payload = buffer.getvalue()
    except Exception as error:
        where, culprit, culprit_error = _find_culprit(fn, args, kwargs) or (
            f"the function {_name(fn)!r}",
            fn,
            error,
        )
        raise PayloadSerializationError(
            f"{where} is a {_type_name(culprit)}, which cannot be pickled to send to the ranks "
            f"({type(culprit_error).__name__}: {culprit_error}). {_ADVICE}"
        ) from error
    if len(payload) >= LARGE_PAYLOAD_BYTES:
        _warn_large(fn, args, kwargs, len(payload))
    return payload


def _warn_large(fn: Callable, args: tuple, kwargs: dict, size: int) -> None:
    """Names the arguments, captured variables and globals that make the call large. Each is pickled
    again to measure it, once more what the call cost already, and only for a call this large."""
    parts = sorted(((_pickled_size(value), where) for where, value in _parts(fn, args, kwargs)), reverse=True)
    large = [f"{where} is {_megabytes(part)}" for part, where in parts if part >= _LARGE_PART_BYTES]
    named = "; ".join(large) if large else f"the function {_name(fn)!r} itself is"
    warnings.warn(
        f"the call of {_name(fn)!r} is {_megabytes(size)} pickled, which every rank reads before it starts: "
        f"{named}. Load such data inside the function instead (pass its path, or the name of a table), so that "
        f"each rank reads what it needs itself",
        PayloadSizeWarning, stacklevel=caller_stacklevel())


class _ByteCounter:
    def __init__(self) -> None:
        self.count = 0

    def write(self, data) -> int:
        self.count += memoryview(data).nbytes
        return self.count


def _pickled_size(value: Any) -> int:
    counter = _ByteCounter()

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        counter.count += buffer.raw().nbytes  # counted, not copied (numpy's arrays and the like)
        return False

    try:
        _Pickler(counter, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=out_of_band).dump(value)
    except Exception:  # pickled whole with the call, it cannot fail alone in a way that matters here
        return 0
    return counter.count


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.0f} MB"


_code_reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)


def _code_reduce_keeping_filename(code: types.CodeType):
    """cloudpickle names every function it sends "<dynamic-code>"; keeping the real file
    name lets a rank's traceback point at the notebook cell or script that defined it."""
    constructor, args = _code_reduce(code)
    return constructor, tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)


class _Pickler(cloudpickle.CloudPickler):
    if _code_reduce is not None:
        dispatch_table = {**cloudpickle.CloudPickler.dispatch_table, types.CodeType: _code_reduce_keeping_filename}


def _find_culprit(fn: Callable, args: tuple, kwargs: dict) -> tuple[str, Any, Exception] | None:
    for where, value in _parts(fn, args, kwargs):
        try:
            cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            return where, value, error
    return None


def _parts(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """What the call carries, each with the words that name it: the arguments, the variables the
    function captured, the globals it uses."""
    candidates: list[tuple[str, Any]] = []
    candidates += [(f"positional argument {i}", value) for i, value in enumerate(args)]
    candidates += [(f"argument {name!r}", value) for name, value in kwargs.items()]
    code_owner = getattr(fn, "__wrapped__", fn)
    if isinstance(code_owner, types.FunctionType):
        closure = code_owner.__closure__ or ()
        for name, cell in zip(code_owner.__code__.co_freevars, closure):
            try:
                candidates.append((f"the variable {name!r} captured by {_name(fn)!r}", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        for name in sorted(_global_names(code_owner.__code__)):
            if name in code_owner.__globals__:
                value = code_owner.__globals__[name]
                if not isinstance(value, types.ModuleType):
                    candidates.append((f"the global {name!r} used by {_name(fn)!r}", value))
    return candidates


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _type_name(value: Any) -> str:
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
