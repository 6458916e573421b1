"""A spare rank: started before its call, it imports what the call's ranks will (torch, numpy:
_launch/spares.py chooses), touching no GPU, then waits on its control channel for the call it
becomes (contract.py, SPARE_CALL): its stdout and stderr, directory, argv and environment.
From there it runs fanrun's worker exactly as a rank started for the call would.

Started as `python -u -c <bootstrap> <sys.path as JSON> <module,module,...>`, by path like the
worker, importing only the standard library besides what it preloads."""

from __future__ import annotations

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
    sys.path[:] = json.loads(sys.argv[1])
    for name in filter(None, sys.argv[2].split(",")):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: B036 - the rank imports it again, and fails there as a cold rank would
            pass
    os.write(_contract["CONTROL_FD"], f"{_contract['SPARE_READY']}\n".encode())
    cwd, argv, env, stdout, stderr = _receive_call()
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # The call's argv is fanrun's worker: `python -u -c <bootstrap> <mode> [args]`.
    if argv[1:3] != ["-u", "-c"]:
        sys.exit(f"fanrun: a spare rank runs fanrun's worker, not {argv!r}")
    sys.argv = ["-c", *argv[4:]]
    exec(compile(argv[3], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


def _receive_call() -> tuple[str, list[str], dict[str, str], int, int]:
    channel = socket.socket(fileno=_contract["CONTROL_FD"])
    try:
        data, fds, _, _ = socket.recv_fds(channel, 65536, 2)
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
