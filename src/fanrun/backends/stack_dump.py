"""Why a rank on this machine cannot dump its stack at a timeout, read from /proc while it still
runs: every backend asks on the machine where the rank runs."""

from __future__ import annotations

import os
import signal


def obstacle(pid: int, signo: signal.Signals) -> str | None:
    """Why `pid` cannot answer `signo` with a stack, as far as /proc tells; None if nothing seen."""
    bit = 1 << (signo - 1)
    try:
        status = _proc_status(f"/proc/{pid}/status")
        threads = [_proc_status(f"/proc/{pid}/task/{tid}/status") for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    state = status.get("State", "")
    if state[:1] in ("T", "t"):
        return f"it is stopped ({state}: SIGSTOP or a debugger)"
    if int(status.get("SigIgn", "0"), 16) & bit:
        return f"it ignores {signo.name}"
    if threads and all(int(thread.get("SigBlk", "0"), 16) & bit for thread in threads):
        return f"it blocks {signo.name} in every thread"
    if not int(status.get("SigCgt", "0"), 16) & bit:
        return f"it has no handler for {signo.name} (faulthandler's was removed)"
    return None


def _proc_status(path: str) -> dict[str, str]:
    with open(path) as file:
        return dict(line.rstrip("\n").split(":\t", 1) for line in file if ":\t" in line)
