"""Runs a command in a network namespace of its own, where only loopback is up, so that a Ray
cluster started there binds every service to 127.0.0.1 and nothing listens beyond the machine:
    python tests/ray/netns.py <command> [args...]
As root, a new network namespace alone; otherwise inside a new user namespace too."""

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
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWNET | CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        error = ctypes.get_errno()
        sys.exit(f"netns.py: unshare failed ({os.strerror(error)}): this machine does not allow a network namespace here")


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
