"""The lines between the caller and the agents. Each agent writes its news to its stdout, which
srun carries to the caller's: `FANRUN-SLURM <node> <+ or .> <part of a pickle, base64>`, a news
item in as many lines as it takes, "." on its last. srun keeps a line whole only up to
LINE_LIMIT bytes: a longer one is cut, and the pieces of two nodes' lines interleave, so no line
here is longer. Any other line there is not the agents', and is shown as it came. The caller
writes its commands to srun's stdin, which srun (--input=all) gives every agent: one word a line,
some with a value."""

from __future__ import annotations

import base64
import pickle

PREFIX = b"FANRUN-SLURM "
# The longest line, its newline included, that srun (22.05) passes on whole from a task with
# others writing at once: one more byte, and its pieces mix with theirs.
LINE_LIMIT = 1024
_MORE, _LAST = b"+", b"."

# The caller's commands.
GO, QUIT, CANCEL, KILL, PUBLISH, GATHER = "go", "quit", "cancel", "kill", "publish", "gather"


def news_lines(node: int, item: tuple) -> bytes:
    """The item as lines of at most LINE_LIMIT bytes."""
    head = PREFIX + str(node).encode() + b" "
    room = LINE_LIMIT - len(head) - 3  # the mark, its space and the newline
    data = base64.b64encode(pickle.dumps(item))
    parts = [data[start:start + room] for start in range(0, len(data), room)]
    return b"".join(head + (_LAST if index == len(parts) - 1 else _MORE) + b" " + part + b"\n"
                    for index, part in enumerate(parts))


class GarbledNews(ValueError):
    """An agent's line that does not read: what came from its node since can no longer be trusted."""

    def __init__(self, message: str, node: int | None) -> None:
        super().__init__(message)
        self.node = node  # None where even the node's number does not read


class News:
    """The caller's reading of the agents' lines: each node's parts joined into its items."""

    def __init__(self) -> None:
        self._parts: dict[int, list[bytes]] = {}

    def read(self, line: bytes) -> tuple[int, tuple | None] | None:
        """None for a line that is not an agent's; (node, None) for one that is a part of an item
        still to be ended; (node, item) at its last part; GarbledNews for an agent's line that
        does not read."""
        if not line.startswith(PREFIX):
            return None
        try:
            node_text, mark, data = line[len(PREFIX):].rstrip(b"\n").split(b" ", 2)
            node = int(node_text)
        except ValueError:
            raise GarbledNews(f"an agent wrote a line that does not read: {line[:80]!r}", None) from None
        if mark not in (_MORE, _LAST):
            raise GarbledNews(f"its agent wrote a line that does not read: {line[:80]!r}", node)
        self._parts.setdefault(node, []).append(data)
        if mark == _MORE:
            return node, None
        whole = b"".join(self._parts.pop(node))
        try:
            return node, pickle.loads(base64.b64decode(whole, validate=True))
        except Exception as error:
            raise GarbledNews(f"its agent wrote news that does not read ({type(error).__name__}: {error})",
                              node) from None


def command_line(command: str, value=None) -> bytes:
    body = b"" if value is None else b" " + base64.b64encode(pickle.dumps(value))
    return command.encode() + body + b"\n"


def read_command(line: bytes) -> tuple[str, object]:
    """(command, value); an end of input reads as KILL: the caller or srun is gone."""
    if not line:
        return KILL, None
    word, _, data = line.strip().partition(b" ")
    return word.decode(), pickle.loads(base64.b64decode(data)) if data else None
