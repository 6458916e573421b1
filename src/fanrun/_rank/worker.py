"""What runs inside each rank: read the call, run it, send back a result or an error envelope.

Started as `python -u -c <bootstrap> function|script|module ...` in a fresh interpreter.
It is run as a file, not imported from the fanrun package, and imports only the standard
library: a rank's start-up time is the user's imports and nothing more. The modules of fanrun's
that it needs (the run contract, the result file's format, the rank's half of tracking) it runs
by path (_sibling).
"""

from __future__ import annotations

import atexit
import errno
import faulthandler
import os
import pickle
import runpy
import stat
import sys
import time
import traceback
import types
from pathlib import Path


def _sibling(name: str) -> dict:
    """The globals of a module of fanrun's beside this file, run by path: a rank imports no
    package of fanrun's, whose __init__ would import the launcher."""
    return runpy.run_path(os.path.join(os.path.dirname(__file__), name))


_contract = types.SimpleNamespace(**_sibling("contract.py"))
# The process groups the function destroys, held until its result is sent (group_release.py).
_groups = _sibling("group_release.py")

STACK_DUMP_SIGNAL = _contract.STACK_DUMP_SIGNAL

# The one-line messages on the control descriptor: "my error is written, I am failing", and
# "my result is written". A function's rank that exits without either has failed.
_FAILED = f"{_contract.CONTROL_FAILED}\n".encode()
_DONE = f"{_contract.CONTROL_DONE}\n".encode()

# The status the rank exits with: 0 once its result is written, the error's code once its
# error is; 1 if the worker itself fails before either.
_exit_status = 1
# Whether the exit handler and the stack dumps are set up: once per process, kept or not.
_handlers_installed = False
# Sends the metrics this rank logged and has not sent yet (tracking.py), before it reports its
# result or its failure.
_flush_metrics = None
# Ends this call's MLflow run in the process, for a rank that stays for the next call (tracking.py).
_end_tracking = None
# progress.py's globals, loaded once per process: the torch functions it times keep calling into
# them, call after call of a kept rank.
_progress = None
# The error this call ended with, where it ended by one: the function's, or the abandon signal's
# (_rank/abandon.py), which a spare rank that may restart in its process reads.
_last_error = None
# Whether this call said CONTROL_FAILED.
_said_failed = False


def bootstrap_code() -> str:
    """The -c program of a rank: runs this file and hands over to its main()."""
    return f"import runpy; runpy.run_path({__file__!r})['main']()"


def main(abandon=None) -> None:
    """Runs the call of sys.argv and os.environ; once per process, or once per call of a rank
    kept between calls (_rank/spare.py). `abandon`: where the rank may restart in its process,
    its Abandon (_rank/abandon.py), which the function runs armed with."""
    global _exit_status, _handlers_installed, _flush_metrics, _end_tracking, _progress, _last_error, _said_failed
    _exit_status, _flush_metrics, _end_tracking, _last_error, _said_failed = 1, None, None, None, False
    if not _handlers_installed:
        _handlers_installed = True
        # Registered first, so that it runs last, after every handler the function registers.
        atexit.register(_exit_before_teardown)
        faulthandler.enable(all_threads=True)
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
    control_fd = os.environ.get(_contract.ENV_CONTROL_FD)
    if control_fd:
        # Processes this rank starts must not hold the engine's channel open.
        os.set_inheritable(int(control_fd), False)
    tracking_hooks = []
    if os.environ.get(_contract.ENV_TRACKING):
        # A call of @distributed: when the function imports mlflow, the call's run becomes
        # active there, or MLflow logs nowhere if the call is not tracked.
        before = list(sys.meta_path)
        tracking = _sibling("tracking.py")
        tracking["install"]()
        _end_tracking = tracking["end_call"]
        _flush_metrics = tracking["flush_metrics"]
        tracking_hooks = [hook for hook in sys.meta_path if not any(hook is old for old in before)]
    _groups["install"]()
    mode = sys.argv[1]
    run_dir = Path(os.environ[_contract.ENV_RUN_DIR])
    rank = int(os.environ["RANK"])
    if os.environ.get(_contract.ENV_PROGRESS) == "1":
        if _progress is None:
            _progress = _sibling("progress.py")
        _progress["install"](str(run_dir), rank)
    if mode == "function":
        _run_function(run_dir, rank, abandon)
    else:
        _run_program(mode, sys.argv[2], sys.argv[3:], run_dir, rank)
    release_groups()
    # Tracking's hook, where this call never imported mlflow, must not wait for the next call.
    sys.meta_path[:] = [hook for hook in sys.meta_path if not any(hook is own for own in tracking_hooks)]
    _exit_status = 0


def release_groups() -> None:
    """Lets go of the process groups the call destroyed (group_release.py): a rank that stays
    for another call does so once its result is out, before it asks whether it may stay."""
    _groups["release"]()


def _exit_before_teardown() -> None:
    """The rank's last exit handler. By now Python has joined the non-daemon threads and run
    the other exit handlers; what is left is the interpreter's teardown, which destroys the
    remaining objects, native ones included. Some of those abort the process there (ranks
    of torch.distributed jobs have, with "terminate called without an active exception"),
    which would turn a rank that returned its result into a failed one. So the rank ends here instead, once
    what the teardown would have written is written."""
    import gc
    import io

    writers = (io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair, io.TextIOWrapper)
    for obj in gc.get_objects():
        # A file left open is flushed when the teardown destroys it: flushed here instead.
        if issubclass(type(obj), writers):  # not isinstance: that asks some objects for __class__, with warnings
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:
                pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # what native code printed through C's stdio
    except Exception:
        pass
    os._exit(_exit_status)


def end_tracking() -> None:
    """For a rank that stays for another call: this call's MLflow run ended in the process, as
    its exit would end it (_rank/tracking.py, end_call)."""
    if _end_tracking is not None:
        _end_tracking()


def take_ended_by() -> tuple[BaseException | None, bool]:
    """The error the last call ended with, no longer held here, and whether it said CONTROL_FAILED."""
    global _last_error
    error, _last_error = _last_error, None
    return error, _said_failed


def _run_function(run_dir: Path, rank: int, abandon) -> None:
    global _last_error
    with _open_payload(run_dir) as payload:
        header = pickle.load(payload)
        sys.path[:] = header["sys_path"]
        try:
            fn, args, kwargs = pickle.load(payload)
        except BaseException as error:
            _fail(run_dir, rank, "exception", error)
    _mark("began_at")
    try:
        if abandon is None:
            result = fn(*args, **kwargs)
        else:
            with abandon.armed():
                result = fn(*args, **kwargs)
    except BaseException as error:
        if abandon is None or not abandon.requested():
            result = _function_failed(run_dir, rank, error)
        else:  # another rank failed first: this one is told so, and reports nothing of its own
            _mark("failed_at")
            _last_error = error
            raise
    _mark("ended_at")
    _send_pending_metrics()
    _send_result(run_dir, rank, result)


def _function_failed(run_dir: Path, rank: int, error: BaseException) -> object:
    """What the function's exception makes of the call: None for sys.exit(0), else its failure."""
    if isinstance(error, SystemExit) and error.code in (None, 0):
        return None
    _mark("failed_at")
    _fail(run_dir, rank, "exit" if isinstance(error, SystemExit) else "exception", error)


def _mark(field: str) -> None:
    """When the function began, returned or raised, in the progress record where the rank keeps one."""
    if _progress is not None and os.environ.get(_contract.ENV_PROGRESS) == "1":
        _progress["mark"](field)


def _open_payload(run_dir: Path):
    """The call's payload, opened through the run directory's descriptor without following a
    link, and only if both are this user's alone: unpickling it runs code, so a file that
    someone else made, or could have changed, is never read."""
    uid = os.geteuid()
    # The directory first: once it is this user's and nobody else can write it, nothing in it
    # can be another user's plant.
    dir_fd = _open_owned(str(run_dir), os.O_DIRECTORY, None, run_dir, uid, others=0o022)
    try:
        fd = _open_owned(_contract.PAYLOAD, 0, dir_fd, run_dir / _contract.PAYLOAD, uid, others=0o077)
    finally:
        os.close(dir_fd)
    return os.fdopen(fd, "rb")


def _open_owned(name: str, flags: int, dir_fd: int | None, where: Path, uid: int, others: int) -> int:
    """Opens name (relative to dir_fd) read-only, without following a link; refuses it unless
    uid owns it and none of the `others` mode bits is set, and unless a file is a regular one."""
    try:
        fd = os.open(name, flags | os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as error:
        # O_NOFOLLOW with O_DIRECTORY reports a link as "not a directory".
        if error.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
            raise PermissionError(f"fanrun: {where} is a symbolic link, which a rank never follows to its payload") from None
        raise
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    problem = None
    if info.st_uid != uid:
        problem = f"belongs to uid {info.st_uid}, not to this rank's user (uid {uid})"
    elif mode & others:
        problem = f"is open to other users (mode {mode:04o})"
    elif not flags & os.O_DIRECTORY and not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    if problem is not None:
        os.close(fd)
        raise PermissionError(f"fanrun: {where} {problem}; a rank unpickles no payload that anyone else could have written")
    return fd


def _run_program(mode: str, target: str, argv: list[str], run_dir: Path, rank: int) -> None:
    if mode == "script":
        sys.argv = [target, *argv]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    else:
        sys.argv = [target, *argv]
        sys.path[0] = os.getcwd()
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    _mark("began_at")
    try:
        run()
    except SystemExit as error:
        if error.code not in (None, 0):
            _mark("failed_at")
            _fail(run_dir, rank, "exit", error)
    except BaseException as error:
        _mark("failed_at")
        _fail(run_dir, rank, "exception", error)
    _mark("ended_at")
    _send_pending_metrics()


def _send_pending_metrics() -> None:
    """What the rank logged and has not sent yet, sent before it reports its result or failure."""
    if _flush_metrics is not None:
        _flush_metrics()


def _send_result(run_dir: Path, rank: int, result: object) -> None:
    import cloudpickle

    result_file = _sibling("result_file.py")
    path = run_dir / _contract.result_name(rank)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        result_file["write"](fd, result, cloudpickle.CloudPickler)
    except Exception as error:
        tmp.unlink(missing_ok=True)
        _fail(run_dir, rank, "result", error, result_type=_type_name(result))
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _tell_engine(_DONE)


def _fail(run_dir: Path, rank: int, kind: str, error: BaseException, result_type: str = "") -> None:
    """Writes the error envelope, tells the engine at once, and exits with the error's status (1, or sys.exit's code)."""
    global _exit_status, _last_error, _said_failed
    _last_error = error
    envelope = {
        "kind": kind,  # "exception", "exit" (sys.exit with a code), "result" (unpicklable return)
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "type": _type_name(error),
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, _skip_worker_frames(error.__traceback__))),
        # Re-formatted in the caller, whose linecache has the source of notebook cells.
        "frames": [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(_skip_worker_frames(error.__traceback__))],
        "exception_only": "".join(traceback.format_exception_only(type(error), error)),
        "exit_code": error.code if isinstance(error, SystemExit) else None,
        "result_type": result_type,
        "exception": _pickle_exception(error),
    }
    try:
        sys.stderr.flush()  # before the traceback, in the log and on screen
    except Exception:
        pass  # stderr closed or replaced by the function: the error file below still carries it all
    if kind != "result":
        # The traceback goes to the log, as an uncaught exception's would; the caller shows it
        # once, with the exception it raises, so it is not printed on the screen here.
        _log_only(envelope["traceback"])
    path = run_dir / _contract.error_name(rank)
    tmp = path.with_name(path.name + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as out:
        pickle.dump(envelope, out, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    _send_pending_metrics()
    _said_failed = True
    _tell_engine(_FAILED)
    code = envelope["exit_code"] if isinstance(envelope["exit_code"], int) else 1
    _exit_status = code or 1
    sys.exit(_exit_status)


def _log_only(text: str) -> None:
    data = text.encode("utf-8", "replace")
    if not os.environ.get(_contract.ENV_CONTROL_FD):
        try:
            sys.stderr.write(text)  # no engine to hand it to: the screen is the log
            sys.stderr.flush()
        except Exception:
            pass
        return
    _tell_engine(f"{_contract.CONTROL_LOG}{len(data)}\n".encode() + data)


def _tell_engine(message: bytes) -> None:
    control_fd = os.environ.get(_contract.ENV_CONTROL_FD)
    if control_fd:
        try:
            view = memoryview(message)
            while view:
                view = view[os.write(int(control_fd), view):]
        except OSError:
            pass


def _skip_worker_frames(tb):
    """The worker's own frames, and runpy's that run a script or module, are noise in the
    user's traceback."""
    own = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in own:
        tb = tb.tb_next
    return tb


def _pickle_exception(error: BaseException) -> bytes | None:
    try:
        import cloudpickle

        data = cloudpickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # an exception whose __init__ cannot take its args fails here
        return data
    except Exception:
        return None


def _type_name(value: object) -> str:
    cls = value if isinstance(value, type) else type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
