"""A rank's half of restarts that keep the processes (contract.py, ENV_KEEP_SURVIVORS). When
another rank fails, the engine sends this one ABANDON_SIGNAL: it leaves its function, its process
group aborted rather than waited on (a dead peer never answers), and waits for the next attempt
with its imports and its CUDA context, unless its process is no longer fit for one.

The signal is blocked in every thread and taken by a thread of its own with sigwait, so that it
arrives while the function's thread is stuck in native code (a collective): that thread aborts
the process group, which ends an NCCL collective, then interrupts the function's thread, which
raises CallAbandoned at its next Python instruction; a second signal, to that thread alone, ends
a blocking call it is in (a sleep, a wait for a batch), whose retry would otherwise wait. (A gloo
collective ends when its peers close their connections, as their aborts do.)

Run by path from _rank/spare.py, importing only the standard library at the top."""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from contextlib import contextmanager


class CallAbandoned(BaseException):
    """Raised in the function when another rank failed: a BaseException, so that the function's
    own `except Exception` does not swallow it."""


class Abandon:
    def __init__(self, signo: int, wake_signo: int) -> None:
        self._signo = signo
        self._wake_signo = wake_signo
        self._armed = False  # the function runs: the signal interrupts it
        self._requested = False  # the signal came since this attempt's call reached the rank
        self._abort_error: str | None = None

    def install(self) -> None:
        """Before anything starts a thread: each thread inherits the blocked signal."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {self._signo})
        # The processes the function forks do not inherit it blocked.
        os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {self._signo}))
        signal.signal(self._signo, self._raise_in_function)  # what interrupt_main(signo) runs
        # Its handler does nothing: the signal's arrival alone ends the blocking call.
        signal.signal(self._wake_signo, lambda signo, frame: None)
        threading.Thread(target=self._take_signals, name="fanrun-abandon", daemon=True).start()

    def call_began(self) -> None:
        """The rank has its call: a signal from here on is this attempt's."""
        self._requested, self._abort_error = False, None

    @contextmanager
    def armed(self):
        """Around the function: the signal interrupts it, or stops it before it starts where
        it came while the rank was still reading its call."""
        self._armed = True
        if self._requested:
            self._armed = False
            raise CallAbandoned("another rank failed before this one began its function")
        try:
            yield
        finally:
            self._armed = False

    def requested(self) -> bool:
        return self._requested

    def _take_signals(self) -> None:
        while True:
            signal.sigwait({self._signo})
            self._requested = True
            if not self._armed:
                continue  # not in the function: armed() or the rank's own end takes it from here
            _thread.interrupt_main(self._signo)
            signal.pthread_kill(threading.main_thread().ident, self._wake_signo)
            self._abort_process_group()

    def _raise_in_function(self, signo, frame) -> None:
        if self._armed:
            self._armed = False
            raise CallAbandoned("another rank failed: this attempt is abandoned, and the next one runs in this process")

    def _abort_process_group(self) -> None:
        distributed = sys.modules.get("torch.distributed")
        if distributed is None or not distributed.is_available() or not distributed.is_initialized():
            return
        try:
            distributed.distributed_c10d._abort_process_group()
        except Exception as error:  # its communicators are in an unknown state
            self._abort_error = f"its process group could not be aborted ({type(error).__name__}: {error})"

    def leave_call(self, error: BaseException | None) -> str | None:
        """After the function's end by failure or by the signal: its process group aborted, and
        why the process cannot take the next attempt (None: it can)."""
        self._armed = False
        self._abort_process_group()
        if self._abort_error is not None:
            return self._abort_error
        return _interrupted_import(error) or _poisoned(error)


def _interrupted_import(error: BaseException | None) -> str | None:
    """CallAbandoned raised while a package was being imported drops the package from
    sys.modules but leaves the submodules it had imported: the next attempt's import of it runs
    its __init__ again, finds them imported, and never binds them to the new package, so that
    its code fails ("partially initialized module"). Such a rank is not reused."""
    if not isinstance(error, CallAbandoned):
        return None
    dropped = sorted({name.rpartition(".")[0] for name in list(sys.modules)
                      if "." in name and name.rpartition(".")[0] not in sys.modules})
    if not dropped:
        return None
    return f"it was stopped while importing {', '.join(dropped)}, whose submodules stay imported without it"


def _poisoned(error: BaseException | None) -> str | None:
    """A CUDA error leaves the process's CUDA context unusable: such a rank is not reused."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__}: {error}"
        if "CUDA error" in text or type(error).__name__ == "AcceleratorError":
            return f"its function failed with a CUDA error, after which its CUDA context cannot be trusted ({text[:200]})"
        error = error.__cause__ or error.__context__
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except Exception as failure:
            return f"its CUDA context failed ({type(failure).__name__}: {failure})"
    return None
