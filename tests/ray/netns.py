"""Runs a command in a network namespace of its own, where only loopback is up, so that a Ray
cluster started there binds every service to 127.0.0.1 and nothing listens beyond the machine:
    python tests/ray/netns.py <command> [args...]
A new network namespace alone where this process may make one (root); otherwise inside a new
user namespace too, with the same uid and gid inside as outside, so that files keep their owners."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


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


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: netns.py <command> [args...]")
    enter_namespace()
    bring_loopback_up()
    os.execvp(sys.argv[1], sys.argv[1:])
