"""The lines between the caller and the agents. Each agent writes its news to its stdout, which
srun carries to the caller's, one whole line at a time: `FANRUN-SLURM <node> <pickle, base64>`;
any other line there is not the agent's, and is shown as it came. The caller writes its commands
to srun's stdin, which srun (--input=all) gives every agent: one word a line, some with a value."""

from __future__ import annotations

import base64
import pickle

PREFIX = b"FANRUN-SLURM "

# The caller's commands.
GO, QUIT, CANCEL, KILL, PUBLISH = "go", "quit", "cancel", "kill", "publish"


def news_line(node: int, item: tuple) -> bytes:
    return PREFIX + str(node).encode() + b" " + base64.b64encode(pickle.dumps(item)) + b"\n"


def read_news(line: bytes) -> tuple[int, tuple] | None:
    """(node, item) of an agent's line; None for any other line."""
    if not line.startswith(PREFIX):
        return None
    node, _, data = line[len(PREFIX):].partition(b" ")
    return int(node), pickle.loads(base64.b64decode(data))


def command_line(command: str, value=None) -> bytes:
    body = b"" if value is None else b" " + base64.b64encode(pickle.dumps(value))
    return command.encode() + body + b"\n"


def read_command(line: bytes) -> tuple[str, object]:
    """(command, value); an end of input reads as KILL: the caller or srun is gone."""
    if not line:
        return KILL, None
    word, _, data = line.strip().partition(b" ")
    return word.decode(), pickle.loads(base64.b64decode(data)) if data else None
