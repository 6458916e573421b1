"""A kept rank between two calls (@distributed(keep_alive=True)): whether it may stay, and what
it undoes once its call is over so that the next call finds it as a fresh rank would be, but for
the modules it has imported and the memory the function left referenced.

Run by path from _rank/spare.py, importing only the standard library at the top."""

from __future__ import annotations

import gc
import os
import random
import sys
import threading


def end_process_group() -> None:
    """What the process's exit would do to a process group the function left initialised, done
    now: the next call meets at a rendezvous of its own."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


def obstacle() -> str | None:
    """Why this rank must end as a cold one would, rather than stay; None if it may stay."""
    if "mlflow" in sys.modules:
        # MLflow flushes what it logged, and ends its runs, as the process exits.
        return "the function imported mlflow, whose logging is complete only once the process exits"
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if threads:
        # A cold rank's exit waits for them; a kept one would leave them running into the next call.
        return f"threads the function started still run ({', '.join(threads)}), and a rank's call ends with them"
    if GLOO_WORKER in _native_threads():
        # DistributedDataParallel over gloo leaves its process group alive after
        # destroy_process_group (torch 2.13); when the next call's group replaces it, its
        # destruction can wait forever for its own worker threads.
        return "torch kept a gloo process group alive after destroy_process_group (as DistributedDataParallel does)"
    return None


# The name of the worker threads of a gloo process group (torch's ProcessGroupGloo).
GLOO_WORKER = "pt_gloo_runloop"


def _native_threads() -> set[str]:
    names = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.add(comm.read().strip())
        except OSError:
            pass  # ended meanwhile
    return names


def release_output() -> None:
    """Everything written so far goes to the call's pipes; from here on, /dev/null."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def tidy() -> None:
    """After the call's results are out: memory given back, and fresh random seeds."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # what the function no longer references is given back
    # A fresh seed for each call, as a fresh process draws one.
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    if torch is not None:
        torch.seed()
