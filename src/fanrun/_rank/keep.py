"""A kept rank between two calls (@distributed(keep_alive=True)): whether it may stay, and what
it undoes once its call is over so that the next call finds it as a fresh rank would be, but for
the modules it has imported and the memory the function left referenced.

Run by path from _rank/spare.py, importing only the standard library at the top."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import select
import signal
import sys
import threading
import time


# prctl's option (linux/prctl.h): orphans below this process are handed to it, not to init.
PR_SET_CHILD_SUBREAPER = 36
# How long the processes a call left get to die after SIGKILL (one stuck in the kernel dies
# only when it leaves it) before the rank ends instead, leaving them to its keeper.
KILL_DEADLINE_S = 10.0


def adopt_orphans() -> None:
    """Makes this rank a child subreaper before its first kept call, so that whatever the
    function starts, in its own session or double-forked, stays a descendant that
    end_descendants() finds, as the rank's keeper finds everything when a cold rank ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"fanrun: a kept rank could not become a child subreaper: {os.strerror(error)}")


def end_descendants() -> str | None:
    """Kills and reaps every process below this rank, as a cold rank's exit would have its keeper
    do; None once none is left, or why the rank must end instead (some outlived SIGKILL)."""
    deadline = time.monotonic() + KILL_DEADLINE_S
    helpers = _multiprocessing_helpers()
    # First all but multiprocessing's helpers, which wait for every process holding their pipes.
    stuck = _kill_and_reap(spared=set(helpers.values()), deadline=deadline)
    if stuck is None:
        failed = _stop_multiprocessing_helpers(helpers)
        if failed is not None:
            return failed
        stuck = _kill_and_reap(spared=set(), deadline=deadline)
    if stuck is None:
        return None
    return f"processes the call started ({', '.join(map(str, stuck))}) were still alive {KILL_DEADLINE_S:g} s after SIGKILL"


def _kill_and_reap(spared: set[int], deadline: float) -> list[int] | None:
    """SIGKILL to every descendant but `spared`, round after round until none is left; the
    descendants still alive at the deadline, or None."""
    while True:
        descendants = [pid for pid in _descendants() if pid not in spared]
        if not descendants:
            return None
        exits: dict[int, int] = {}  # pidfd -> pid
        try:
            for pid in descendants:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # gone since the scan
                exits[fd] = pid
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited meanwhile: its pidfd is readable already
            # A process forked meanwhile, or handed to this rank by a parent that died, is in the
            # next round's scan.
            waiting = select.poll()
            for fd in exits:
                waiting.register(fd, select.POLLIN)
            alive = dict(exits)
            while alive:
                left_ms = int((deadline - time.monotonic()) * 1000)
                ready = waiting.poll(left_ms) if left_ms > 0 else []
                if not ready:
                    return sorted(alive.values())
                for fd, _events in ready:
                    waiting.unregister(fd)
                    del alive[fd]
        finally:
            for fd in exits:
                os.close(fd)
        for pid in exits.values():
            try:
                os.waitpid(pid, os.WNOHANG)  # this rank's own children; the others' parents reap them, or die
            except ChildProcessError:
                pass


def _descendants() -> list[int]:
    """Every process below this one that is alive, and this one's own children that have ended
    unreaped. (The others that have ended are their parents' to reap; where a parent dies
    first, they come to this subreaper.)"""
    me = os.getpid()
    children_of = _children_from_lists if os.path.exists("/proc/thread-self/children") else _children_from_scan()
    found: list[int] = []
    pending = [me]
    while pending:
        parent = pending.pop()
        for child in children_of(parent):
            if parent == me or not _ended(child):
                found.append(child)
            pending.append(child)
    return found


def _children_from_lists(pid: int) -> list[int]:
    """The kernel's lists of a process's children, one for each of its threads (any may fork)."""
    children = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children  # ended meanwhile
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as listed:
                children += [int(child) for child in listed.read().split()]
        except OSError:
            pass
    return children


def _children_from_scan():
    """Without the kernel's lists (CONFIG_PROC_CHILDREN), every process's parent from its stat."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            parent = _stat_fields(int(name))[1:2]
            if parent:
                children.setdefault(int(parent[0]), []).append(int(name))
    return lambda pid: children.get(pid, [])


def _ended(pid: int) -> bool:
    return _stat_fields(pid)[:1] in ([b"Z"], [])


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command's name (state, parent, ...); [] once gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return []
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return fields[fields.rindex(b")") + 2:].split()


def _multiprocessing_helpers() -> dict[str, int]:
    """The pids of multiprocessing's fork server and resource tracker, where this rank runs them."""
    helpers = {}
    forkserver = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        helpers["forkserver"] = pid
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    if pid is not None:
        helpers["resource_tracker"] = pid
    return helpers


def _stop_multiprocessing_helpers(helpers: dict[str, int]) -> str | None:
    """multiprocessing's fork server and resource tracker serve every later call too, and
    remember their pids: stopped their own way, they are started afresh when next needed,
    where killed under them the fork server would fail its next call. The tracker's stop also
    frees what the function's semaphores and shared memory left, as at a cold rank's exit.
    Each stops once no other process holds its pipe: the others are gone by now. None, or why
    the rank must end instead."""
    try:
        if "forkserver" in helpers:
            sys.modules["multiprocessing.forkserver"]._forkserver._stop()
        if "resource_tracker" in helpers:
            sys.modules["multiprocessing.resource_tracker"]._resource_tracker._stop()
    except OSError as error:  # the function reaped one itself: its state is no longer to be trusted
        return f"multiprocessing's helper processes could not be stopped for the next call ({error})"
    return None


def end_process_group() -> None:
    """What the process's exit would do to a process group the function left initialised, done
    now: the next call meets at a rendezvous of its own."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


def obstacle() -> str | None:
    """Why this rank must end as a cold one would, rather than stay; None if it may stay."""
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
    fresh_seeds()  # for each call, as a fresh process draws one


def fresh_seeds() -> None:
    """New seeds for random's, numpy's and torch's global generators, drawn as a fresh process
    draws them: a kept rank's next call, and a spare forked from the zygote, whose generators are
    the zygote's, start from them."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
