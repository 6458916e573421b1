"""Serializing the call once, in the caller, and naming the object that cannot be pickled."""

from __future__ import annotations

import io
import pickle
import types
from typing import Any, Callable

import cloudpickle

from ._errors import PayloadSerializationError

_ADVICE = (
    "Create it inside the function instead, so that each rank makes its own "
    "(for a large dataset, load it inside the function too, so that each rank reads it itself)."
)


def serialize_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args, kwargs))
        return buffer.getvalue()
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
    for where, value in candidates:
        try:
            cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            return where, value, error
    return None


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
