"""A spare rank: started before its call, it imports what the call's ranks will (torch, numpy:
backends/local/spares.py chooses), touching no GPU, then waits on its control channel for the call it
becomes (contract.py, SPARE_CALL): its stdout and stderr, directory, argv and environment.
From there it runs fanrun's worker exactly as a rank started for the call would. A call with
keep_alive (contract.py, ENV_KEEP_ALIVE) that ends well leaves it waiting for the next call, in
the same process (_rank/keep.py).

Started as `python -u -c <bootstrap> <sys.path as JSON> <module,module,...> [zygote]`, by path like
the worker, importing only the standard library besides what it preloads. With `zygote`, it is a
spare zygote instead (_rank/zygote.py): once its imports are done, it forks spares, and this
function goes on in each of them."""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import socket
import sys

_contract = runpy.run_path(os.path.join(os.path.dirname(__file__), "contract.py"))


def bootstrap_code() -> str:
    return f"import runpy; runpy.run_path({__file__!r})['main']()"


def main() -> None:
    here = os.path.dirname(__file__)
    zygote = sys.argv[3:4] == ["zygote"]
    # Before any import starts a thread (abandon.py): the restarts that keep the processes. A
    # zygote's spares install it after their fork, which leaves them a single thread.
    abandon = runpy.run_path(os.path.join(here, "abandon.py"))["Abandon"](_contract["ABANDON_SIGNAL"],
                                                                             _contract["ABANDON_WAKE_SIGNAL"])
    if not zygote:
        abandon.install()
    sys.path[:] = json.loads(sys.argv[1])
    for name in filter(None, sys.argv[2].split(",")):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: B036 - the rank imports it again, and fails there as a cold rank would
            pass
    # What the imports made lives as long as the process: out of the collector's sight, the
    # collections after each call (a survivor's, keep.tidy) take a millisecond instead of a tenth
    # of a second with torch imported, which a restart that keeps the processes waits for.
    gc.freeze()
    _tell(_contract["SPARE_READY"])
    worker = runpy.run_path(os.path.join(here, "worker.py"))
    if zygote:
        runpy.run_path(os.path.join(here, "zygote.py"))["serve_forks"](_contract)
        abandon.install()  # in a forked spare, ready for its call
    keep = None
    while True:
        call = _receive_call()
        if call is None:
            return  # the caller let it go without another call
        cwd, argv, env, stdout, stderr = call
        abandon.call_began()
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        # The call's argv is fanrun's worker: `python -u -c <bootstrap> <mode> [args]`.
        if argv[1:3] != ["-u", "-c"] or argv[3] != worker["bootstrap_code"]():
            sys.exit(f"fanrun: a spare rank runs fanrun's worker, not {argv!r}")
        sys.argv = ["-c", *argv[4:]]
        kept = os.environ.get(_contract["ENV_KEEP_ALIVE"]) == "1"
        survives = os.environ.get(_contract["ENV_KEEP_SURVIVORS"]) == "1"
        if (kept or survives) and keep is None:
            keep = runpy.run_path(os.path.join(here, "keep.py"))
            keep["adopt_orphans"]()
        obstacle = None
        try:
            worker["main"](abandon if survives else None)  # a call that fails exits here, unless it survives
            abandoned = False
        except BaseException:
            error, said_failed = worker["take_ended_by"]()
            if not survives or not (said_failed or abandon.requested()):
                raise
            abandoned = True
            obstacle = abandon.leave_call(error)
            del error
        if abandoned:
            # Out of the handler, where nothing holds the error's frames, and with them the process
            # group that torch ends once nothing refers to it (its gloo threads with it).
            gc.collect()
            worker["release_groups"]()  # after the frames, so that these are the groups' last references
            worker["end_tracking"]()
            obstacle = obstacle or keep["obstacle"]() or keep["end_descendants"]()
            if obstacle is not None:
                print(f"fanrun: rank {os.environ.get('RANK')} ends instead of taking the next attempt: {obstacle}",
                      file=sys.stderr, flush=True)
                sys.exit(1)
            keep["release_output"]()
            _tell(_contract["CONTROL_KEPT"])
            keep["tidy"]()
            continue
        if not kept:
            return
        keep["end_process_group"]()
        worker["release_groups"]()
        worker["end_tracking"]()
        # A cold rank's call ends with every process it started (its keeper kills them): so does a kept one's.
        obstacle = keep["obstacle"]() or keep["end_descendants"]()
        if obstacle is not None:
            if os.environ.get("RANK") == "0":
                print(f"fanrun: the ranks end after this call instead of staying for the next (keep_alive): {obstacle}",
                      file=sys.stderr, flush=True)
            return
        keep["release_output"]()
        _tell(_contract["CONTROL_KEPT"])
        keep["tidy"]()


def _tell(word: str) -> None:
    os.write(_contract["CONTROL_FD"], f"{word}\n".encode())


def _receive_call() -> tuple[str, list[str], dict[str, str], int, int] | None:
    """The next call; None once the caller has closed the channel."""
    channel = socket.socket(fileno=_contract["CONTROL_FD"])
    try:
        data, fds, _, _ = socket.recv_fds(channel, 65536, 2)
        if not data:
            return None
        head, _, body = data.partition(b"\n")
        word = _contract["SPARE_CALL"].encode()
        if not head.startswith(word) or len(fds) != 2:
            sys.exit("fanrun: a spare rank's control channel brought no call")
        length = int(head[len(word):])
        while len(body) < length:
            more = channel.recv(max(65536, length - len(body)))
            if not more:
                sys.exit("fanrun: a spare rank's call was cut short")
            body += more
    finally:
        channel.detach()  # the descriptor stays: it is the rank's control channel from here
    fields = [field.decode("utf-8", "surrogateescape") for field in body.split(b"\0")[:-1]]
    count = int(fields[1])
    argv, entries = fields[2:2 + count], fields[2 + count:]
    env = dict(entry.split("=", 1) for entry in entries)
    return fields[0], argv, env, fds[0], fds[1]
