"""Methods whose errors for the caller reach it with the caller's frames alone, none of fanrun's.

An exception gains a traceback entry for every Python frame it passes through, and the frame that
raises it is one of them: a `raise` anywhere in fanrun leaves that frame in what a script prints and
what a notebook shows. So the method runs to a normal return (its value, or the error to raise),
and the raise is done by C code called from the caller's own frame, where no Python frame of
fanrun's lies in between:

    caller's frame -> bound method (C) -> type.__call__ (C): __new__ runs the method, returns
    -> __init__ looked up (C): property -> next(self) (C) -> map -> finished_generator.throw(error) (C)

A finished generator's throw() raises what it is given without running any frame. An exception
that is not for the caller (_errors.raised_for_the_caller: a fault of fanrun's) leaves the method
the ordinary way, with every frame, which is its story.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from typing import Any, Callable, TypeVar, cast

from . import _errors

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _finished_generator():
    return
    yield


_generator = _finished_generator()
next(_generator, None)
_THROW = _generator.throw


class _RaisedFromTheCaller(map):
    """One call of the wrapped method: the method's value, or (an instance of this class) its error,
    raised when type.__call__ looks up __init__."""

    _method: Callable[..., Any]
    # type.__call__ looks __init__ up on an instance of the class __new__ returned: the property
    # runs next(instance), and the map calls _THROW(error), all in C.
    __init__ = property(next)  # type: ignore[assignment]

    def __new__(cls, instance: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return cls._method(instance, *args, **kwargs)
        except BaseException as error:
            if not _errors.raised_for_the_caller(error):
                raise
            # fanrun's frames go; the cause (a rank's traceback) stays.
            return map.__new__(cls, _THROW, (error.with_traceback(None),))


def raised_from_the_caller(method: _Method) -> _Method:
    """Decorates a method: errors for the caller are raised with the caller's frames only. To type
    checkers the method stays what it was."""
    call = type(method.__name__, (_RaisedFromTheCaller,), {
        "_method": staticmethod(method),
        "__doc__": method.__doc__,
        "__module__": method.__module__,
        "__qualname__": method.__qualname__,
        "__signature__": inspect.signature(method),
    })
    return cast(_Method, property(functools.partial(types.MethodType, call), doc=method.__doc__))


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_stacklevel() -> int:
    """The stacklevel of warnings.warn, called by the function that calls this, that names the
    first frame outside fanrun: the caller's own line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
