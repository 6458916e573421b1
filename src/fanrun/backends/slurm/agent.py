"""One node's agent of a Slurm call: `python -m fanrun.backends.slurm.agent SPEC`, started by
srun once per node (SLURM_NODEID is the node's number in the step).

It says hello (its node, its address, its versions, whether it sees the call's run directory),
waits for the caller's go (node 0's address and rendezvous port), runs the node's ranks with
node_agent.py's NodeAgent, and writes their news to stdout as wire.py's lines. Its ranks' result,
error and log files go into the call's run directory, which every node shares. SIGTERM (scancel,
the job's time limit, srun told to stop) cancels the ranks, and is said at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ..node_agent import NodeAgent
from ..versions import installed_versions
from . import wire


def node_address(name: str | None) -> str:
    """The node's NodeAddr as Slurm knows it: its hostname may not resolve on other nodes."""
    if name:
        try:
            shown = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True, timeout=30)
            for word in shown.stdout.split():
                if word.startswith("NodeAddr="):
                    return word.split("=", 1)[1]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return socket.gethostbyname(socket.gethostname())


def main(spec_path: str) -> int:
    node = int(os.environ.get("SLURM_NODEID", "0"))
    out = sys.stdout.buffer
    lock = threading.RLock()  # the SIGTERM handler may say its line while the main thread says one

    def say(item: tuple) -> None:
        with lock:
            out.write(wire.news_lines(node, item))
            out.flush()

    spec_file = Path(spec_path)
    name = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    address = node_address(name)
    agent = NodeAgent()
    found = spec_file.is_file() and _owned_by_me_alone(spec_file.parent)
    port = agent.hold_rendezvous(address) if found and node == 0 else None
    spec = json.loads(spec_file.read_text()) if found else None
    layout = spec["layout"] if spec else {}
    health = agent.check_health(spec["health"], layout["local_world_size"] if layout["use_gpus"] else 0) if spec else []
    say(("hello", {"name": name, "hostname": socket.gethostname(), "address": address, "port": port,
                   "versions": installed_versions(), "sees_run_dir": found, "health": health}))
    command, value = wire.read_command(sys.stdin.buffer.readline())
    if command != wire.GO:
        return 0
    spec["master_addr"], spec["master_port"] = value
    spec["layout"] = {**spec["layout"], "node_rank": node}
    spec["node_id"] = name
    payload = Path(spec["payload"]).read_bytes() if spec["payload"] else None
    stopped = []

    def stop(signum, _frame) -> None:
        # Slurm's SIGTERM (scancel, the time limit) reaches the ranks too: the caller hears why
        # before it hears of their ends, and the ranks left are cancelled.
        if not stopped:
            stopped.append(signal.Signals(signum).name)
            say(("stopping", stopped[0]))
        agent.cancel()

    signal.signal(signal.SIGTERM, stop)
    say(("started", agent.start(spec, payload)))
    threading.Thread(target=_obey, args=(agent,), name="fanrun-slurm-commands", daemon=True).start()
    shared = Path(spec["shared_dir"])
    while True:
        batch, ending = agent.next_batch()
        if batch:
            say(("batch", batch))
        if ending is not None:
            for file_name, data in ending.pop("files", {}).items():
                _write_private(shared / file_name, data)
            ending["files"] = {}
            say(("ended", ending))
            return 0


def _owned_by_me_alone(directory: Path) -> bool:
    """Whether the run directory is this user's and no one else can write it, as the caller made
    it: the payload it holds is unpickled by the ranks, so one that another user could have
    planted is not run."""
    st = directory.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _write_private(path: Path, data: bytes) -> None:
    """A file of the call's run directory, as the caller's own are: readable by its user alone,
    and new (a file or link already there is never written through)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as file:
        file.write(data)


def _obey(agent: NodeAgent) -> None:
    """The caller's commands, from srun's stdin, until it ends: then the caller is gone."""
    while True:
        command, value = wire.read_command(sys.stdin.buffer.readline())
        if command == wire.CANCEL:
            agent.cancel()
        elif command == wire.PUBLISH:
            agent.publish(value)
        elif command == wire.GATHER:
            agent.gather()
        elif command == wire.KILL:
            agent.kill()
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
