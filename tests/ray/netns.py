"""Runs a command in a network namespace of its own, where only loopback is up, so that a Ray
cluster started there binds every service to 127.0.0.1 and nothing listens beyond the machine:
    python tests/ray/netns.py [--grace SECONDS] <command> [args...]
A new network namespace alone where this process may make one (root); otherwise inside a new
user namespace too, with the same uid and gid inside as outside, so that files keep their owners.

When the command ends, every process still in the namespace was left behind by it (a Ray
daemon that outlived its cluster): each is given --grace seconds to end, then killed and
named, and the exit status is 1 even where the command succeeded."""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from processes import wait_gone  # noqa: E402  (tests/processes.py)

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_CHILD_SUBREAPER = 36
# Ray's daemons end within a few seconds of its shutdown; what is still there after this is left.
DEFAULT_GRACE_S = 15.0


def enter_namespace() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return
    alone = os.strerror(ctypes.get_errno())
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWNET | CLONE_NEWUSER) != 0:
        sys.exit(f"netns.py: this machine allows no network namespace here: unshare failed ({alone}; with a "
                 f"user namespace: {os.strerror(ctypes.get_errno())})")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)


def bring_loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(control, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(control, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def processes_in_this_namespace() -> dict[int, str]:
    """Every other live process in this network namespace, by pid, with its command line."""
    ours = os.stat("/proc/self/ns/net").st_ino
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino != ours:
                continue
            with open(f"/proc/{entry}/stat") as file:
                if file.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                found[int(entry)] = file.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except (OSError, IndexError):
            continue  # gone meanwhile
    return found


def wait_for_exits(pids, timeout: float) -> None:
    """Waits for them, reaping what this process (their subreaper) inherited, up to `timeout`."""
    wait_gone(list(pids), timeout)
    reap_orphans()


def reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run(argv: list[str], grace_s: float) -> int:
    # Orphans of the command become this process's children, so that they can be reaped here.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    command = subprocess.Popen(argv)
    # A terminal's Ctrl+C reaches the command itself; a SIGTERM sent here is passed on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signo, _: command.send_signal(signo))
    returncode = command.wait()
    if returncode < 0:  # killed by a signal: the status a shell shows
        returncode = 128 - returncode
    left = processes_in_this_namespace()
    wait_for_exits(left, grace_s)
    left = processes_in_this_namespace()
    if not left:
        return returncode
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for_exits(left, 5.0)
    print(f"netns.py: the command (exit status {returncode}) left {len(left)} processes running "
          f"{grace_s:g} s after it ended; they are killed now:", file=sys.stderr)
    for pid, cmdline in sorted(left.items()):
        print(f"  {pid}: {cmdline}", file=sys.stderr)
    return returncode or 1


if __name__ == "__main__":
    args, grace_s = sys.argv[1:], DEFAULT_GRACE_S
    if args[:1] == ["--grace"] and len(args) > 1:
        grace_s, args = float(args[1]), args[2:]
    if not args:
        sys.exit("usage: netns.py [--grace SECONDS] <command> [args...]")
    enter_namespace()
    bring_loopback_up()
    sys.exit(run(args, grace_s))
