"""A spare zygote's loop (cpp/include/fanrun/spare_zygote.h): once its imports are done, it forks
a spare for each request on its control channel (contract.py, ZYGOTE_FORK), and returns only in
a forked spare, whose control channel is then descriptor CONTROL_FD.

Each request forks twice. The first child leaves the zygote's process group, forks the spare,
and becomes its keeper (`fanrun-keeper --adopt <spare>`), whose channel came with the request:
the spare is the keeper's child, as a rank started by exec is, and outlives the zygote.

Run by path from _rank/spare.py; the standard library alone."""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys


def serve_forks(contract: dict) -> None:
    control_fd = contract["CONTROL_FD"]
    # The keepers it forks are reaped by the kernel: nothing here waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    channel = socket.socket(fileno=control_fd)
    word = contract["ZYGOTE_FORK"].encode()
    # Loaded once here, shared by every fork.
    fresh_seeds = runpy.run_path(os.path.join(os.path.dirname(__file__), "keep.py"))["fresh_seeds"]
    while True:
        data, fds, _, _ = socket.recv_fds(channel, 4096, 2)
        if not data:
            os._exit(0)  # the caller let it go
        if not data.startswith(word) or not data.endswith(b"\n") or len(fds) != 2:
            sys.exit("fanrun: a spare zygote's control channel brought no fork request")
        keeper, (keeper_channel, spare_channel) = os.fsdecode(data[len(word):-1]), fds
        pid = os.fork()
        if pid == 0:
            channel.detach()
            _become_keeper_of_a_spare(keeper, keeper_channel, spare_channel, control_fd)
            fresh_seeds()  # in the spare alone: its generators were the zygote's
            return
        os.close(keeper_channel)
        os.close(spare_channel)
        channel.sendall(f"{pid}\n".encode())


def _become_keeper_of_a_spare(keeper: str, keeper_channel: int, spare_channel: int, control_fd: int) -> None:
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the keeper waits for its spare
        os.setpgid(0, 0)  # dropping the zygote, which kills its group, leaves this one
        spare = os.fork()
        if spare == 0:
            os.setpgid(0, 0)  # as a rank's program is: a group of its own
            os.dup2(spare_channel, control_fd)
            os.close(spare_channel)
            os.close(keeper_channel)
            return
        os.dup2(keeper_channel, 0)
        os.close(keeper_channel)
        os.close(spare_channel)
        os.close(control_fd)
        os.execv(keeper, [keeper, "--adopt", str(spare)])
    except BaseException:  # noqa: B036 - a failed fork ends here: the keeper's channel shows it
        os._exit(127)

