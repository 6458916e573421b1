"""A second address on loopback, which Slurm needs in a network namespace where only `lo` is up.

Slurm resolves every address, even "127.0.0.1", through getaddrinfo with AI_ADDRCONFIG, and glibc
then answers only where some IPv4 address other than 127.0.0.1 is configured: with loopback alone,
every daemon and client fails with "Unable to resolve". 127.0.0.2 on lo (as lo:slurm) is such an
address, and reaches nothing beyond the namespace."""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCSIFADDR = 0x8916
SECOND_ADDRESS = "127.0.0.2"


def add_second_loopback_address() -> None:
    """Adds SECOND_ADDRESS to lo; again is harmless (the label's address is set anew)."""
    sockaddr = struct.pack("H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(SECOND_ADDRESS))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
        fcntl.ioctl(control, SIOCSIFADDR, struct.pack("16s", b"lo:slurm") + sockaddr)
