"""The control channel between a caller and its tracking agent (agent_connection.py, agent.py):
one JSON object per packet of a SOCK_SEQPACKET socket pair, and the bounds both ends keep.

Every message names its call by the id the caller gave it, so that one agent serves the calls of
every thread of the caller at once:

  caller -> agent  {"call": {"id", what the run needs, "env": changes, "cwd"}}   + the call's metric socket
                   (an attempt's names its submission's id as "parent_call": its run is nested there)
                   {"directory": {"id", "run_dir", "world_size"}}  once the attempt's directory is made
                   {"finish": {"id", "status", "tags", "run_dir", "world_size"}}  once the ranks have ended
  agent -> caller  {"opened": {"id", the run}} | {"off": {"id", "problem"}} | {"not_found": {"id", "message"}}
                   {"closed": {"id", "warnings": [...]}}                          the call's run is done with

The call's metric socket (the listener its ranks connect to, made before they start) travels
beside its "call" message as a descriptor (SCM_RIGHTS).
"""

from __future__ import annotations

import array
import json
import socket

# Bounds on the agent's MLflow work: a stalled store costs this much, never a hang.
START_DEADLINE_S = 20.0
FINISH_DEADLINE_S = 60.0
# On top of those: the agent's own start (an interpreter, fanrun and mlflow imported) on a busy machine.
AGENT_START_S = 60.0
# The most the agent takes to close a run once it has the call's outcome, each step within its own
# bound: a run still being made (an attempt's after its submission's), the last system sample, the
# ranks' last values, the close itself.
CLOSE_DEADLINE_S = 2 * START_DEADLINE_S + 3 * FINISH_DEADLINE_S
# Larger than any message (a call's description with the environment's changes, an outcome).
MAX_MESSAGE = 1 << 20
# A message carries at most one descriptor; room for more shows a peer that sent too many.
_MAX_FDS = 4


def send(channel: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    """One message, with the descriptors `fds` beside it (the receiver gets copies)."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(channel, [data], list(fds))
    else:
        channel.send(data)


def receive(channel: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors that came with it; (None, []) once the other end has
    closed. The descriptors are close-on-exec from birth: a process the agent starts (MLflow runs
    git for a run's source) must not hold a call's metric socket open."""
    # Not socket.recv_fds: it drops the flags it is given (CPython 3.11), MSG_CMSG_CLOEXEC with them.
    descriptors = array.array("i")
    room = socket.CMSG_LEN(_MAX_FDS * descriptors.itemsize)
    data, ancillary, flags, _ = channel.recvmsg(MAX_MESSAGE, room, socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors.frombytes(payload[: len(payload) - len(payload) % descriptors.itemsize])
    fds = list(descriptors)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            socket.close(fd)
        raise ValueError(f"a message on the tracking agent's channel was cut short (flags {flags:#x})")
    return (json.loads(data) if data else None), fds


def describe(error: BaseException) -> str:
    """A cause in one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
