"""Spare ranks: fresh interpreters started ahead of a call, each with the heavy modules the call's
ranks will import already imported (torch alone takes seconds), waiting to be handed its call
(cpp/include/fanrun/spare_rank.h, _rank/spare.py). A warm call takes as many as it has ranks,
and as it starts, as many are started for the next one.

None is forked from the caller, so a caller that has initialised CUDA or holds threads is no
obstacle, and none touches a GPU itself. The pool's spares are forked from a spare zygote
(cpp/include/fanrun/spare_zygote.h, _rank/zygote.py): one interpreter, started by exec, that
has done the imports once. A fork is ready in milliseconds, so calls shorter than an import
still find their spares ready; a spare that cannot be forked is started by exec. Spares are the
caller's descendants under keepers: they die with it. They end after IDLE_TIMEOUT_S unused, and
are replaced when what they were started with has changed: the interpreter, sys.path, the
working directory, the environment, or the packages installed on sys.path."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import weakref

from ... import _core
from ..._accelerators import usable_cores
from ..._rank import contract
from ..._rank.spare import bootstrap_code

# Imported by every spare when the caller has imported them: the heavy third-party modules of
# training code, whose import is safe without a GPU. Never the caller's own modules, nor __main__.
PRELOADABLE = (
    "torch", "numpy", "scipy", "pandas", "sklearn", "torchvision", "torchaudio", "transformers", "datasets",
    "tokenizers", "safetensors", "accelerate", "deepspeed", "lightning", "pytorch_lightning", "timm",
)
IDLE_TIMEOUT_S = 600.0
# How long the pool waits for its zygote's imports before it starts spares by exec instead.
ZYGOTE_IMPORT_LIMIT_S = 600.0
# FANRUN_WARM=1 makes every call warm unless its decorator says warm=False; 0 makes none warm.
ENV_WARM = "FANRUN_WARM"
# Where nothing else decides, a function's calls are warm on a machine with this many cores for
# each rank: one call's ranks and the spares' zygote then import beside each other without
# slowing the call down. On a one-GPU host (16 cores) starting the zygote costs a first call
# nothing measurable; on 2 cores and 2 ranks it costs a first call of 1.0 s 0.4 s more
# (docs/warm.md, Calls in a loop), so there calls stay cold unless asked.
WARM_CORES_PER_RANK = 4


class SparePool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spares: list = []
        self._started_with: tuple | None = None
        # The zygote and the spare command it was started with; its own lock, since forks are
        # asked for both under the pool's lock (fill) and without it (start).
        self._zygote_lock = threading.Lock()
        self._zygote = None
        self._zygote_command: tuple | None = None
        self._importing = None  # the zygote a fill waits for, which drop() ends
        self._generation = 0  # counts drops
        self._idle_timer: threading.Timer | None = None
        self._filling: threading.Thread | None = None
        self.preload: tuple[str, ...] = ()  # besides PRELOADABLE's: fanrun.warmup(preload=...)
        # Spares import mlflow too: the last call was tracked, or (fanrun.warmup) calls are by
        # default. Where the function imports it, its import is then done; where it does not,
        # the rank makes the call's run active at its start.
        self.mlflow = False
        self.warmed_up = False  # fanrun.warmup() was called: calls are warm unless told otherwise

    def take(self, count: int) -> list:
        """Up to `count` spares that still wait, started as this process would start them now."""
        self._wait_for_filling()
        with self._lock:
            if self._started_with != _starting_point():
                self._drop_locked()
                return []
            waiting = [spare for spare in self._spares if spare.waiting()]
            taken, self._spares = waiting[:count], waiting[count:]
            return taken

    def fill_soon(self, count: int, keeper: str, rank_defaults: dict[str, str]) -> None:
        """fill() in a thread of its own, so that the call that asks for it returns at once. (A
        keeper's parent-death signal comes when the thread that started it ends, too; the keeper
        ignores it while its parent process lives, so these spares still end only with the caller.)"""
        self._wait_for_filling()
        self._filling = threading.Thread(target=self._fill_quietly, args=(count, keeper, rank_defaults),
                                         name="fanrun-spares", daemon=True)
        self._filling.start()

    def _fill_quietly(self, count: int, keeper: str, rank_defaults: dict[str, str]) -> None:
        try:
            self.fill(count, keeper, rank_defaults)
        except Exception:
            self.drop()  # the next call starts cold, and meets whatever stopped this as its own error

    def _wait_for_filling(self) -> None:
        filling = self._filling
        if filling is not None and filling is not threading.current_thread():
            filling.join()

    def fill(self, count: int, keeper: str, rank_defaults: dict[str, str]) -> None:
        """Starts spares until `count` wait, replacing any started from another starting point."""
        starting_point = _starting_point()
        with self._lock:
            if self._started_with != starting_point:
                self._drop_locked()
                self._started_with = starting_point
            self._spares = [spare for spare in self._spares if spare.waiting()]
            self._spares += self._started(count - len(self._spares), keeper, rank_defaults, start_zygote=True)
            self._restart_idle_timer_locked()

    def start(self, count: int, keeper: str, rank_defaults: dict[str, str]) -> list:
        """`count` spares started now, for the caller to hand their calls (none kept here):
        forked where the pool's zygote is ready for them, else started by exec."""
        return self._started(count, keeper, rank_defaults, start_zygote=False)

    def _started(self, count: int, keeper: str, rank_defaults: dict[str, str], *, start_zygote: bool) -> list:
        """`count` spares: forked from the zygote, started first and waited for where
        `start_zygote`; else forked only from a zygote ready now. The rest by exec."""
        if count <= 0:
            return []
        argv, env = self._spare_command(rank_defaults)
        generation = self._generation
        # Without start_zygote, a zygote another thread is waiting for does not hold this up.
        if self._zygote_lock.acquire(blocking=start_zygote):
            try:
                zygote = self._zygote_for_locked((*argv, *env, os.getcwd()), argv, env, start_zygote)
                if zygote is not None:
                    try:
                        return [zygote.fork(keeper) for _ in range(count)]
                    except Exception:
                        self._zygote = None  # it ended: these spares start by exec, the next fill starts another
            finally:
                self._zygote_lock.release()
        if generation != self._generation:
            return []  # the pool was dropped while its zygote imported
        return [_core.SpareRank.start(argv=argv, env=env, cwd=os.getcwd(), keeper=keeper) for _ in range(count)]

    def _zygote_for_locked(self, command: tuple, argv: list[str], env: list[str], start: bool):
        """The zygote of spares started with `command`, its imports done; None where there is
        none and `start` is false, or it failed before its imports were done."""
        if self._zygote_command != command or (self._zygote is not None and not self._zygote.alive()):
            self._zygote, self._zygote_command = None, None  # it ends; the spares forked from it do not
        if self._zygote is None:
            if not start:
                return None
            self._zygote = self._importing = _core.SpareZygote.start(argv=[*argv, "zygote"], env=env, cwd=os.getcwd())
            self._zygote_command = command
        try:
            ready = self._zygote.wait_ready(ZYGOTE_IMPORT_LIMIT_S if start else 0.0)
        finally:
            self._importing = None
        if not ready:
            if start:
                self._zygote, self._zygote_command = None, None
            return None
        return self._zygote

    def drop(self) -> None:
        # A zygote still importing for a fill ends now, rather than be waited for.
        self._generation += 1
        importing = self._importing
        if importing is not None:
            importing.kill()
        self._wait_for_filling()
        with self._lock:
            self._drop_locked()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every spare's imports are done, waiting up to timeout_s for them."""
        self._wait_for_filling()
        with self._lock:
            spares = list(self._spares)
        return all(spare.wait_ready(max(0.0, timeout_s)) for spare in spares)

    def pids(self) -> list[int]:
        self._wait_for_filling()
        with self._lock:
            return [spare.pid for spare in self._spares if spare.waiting()]

    def zygote_pid(self) -> int | None:
        """The zygote's, while it lives, its imports done or not (without waiting for a fill)."""
        zygote = self._zygote
        return zygote.pid if zygote is not None and zygote.alive() else None

    def _spare_command(self, rank_defaults: dict[str, str]) -> tuple[list[str], list[str]]:
        modules = [name for name in PRELOADABLE if name in sys.modules] + [m for m in self.preload if m not in PRELOADABLE]
        if self.mlflow and "mlflow" not in modules:
            modules.append("mlflow")
        argv = [sys.executable, "-u", "-c", bootstrap_code(), json.dumps(sys.path), ",".join(modules)]
        # What the ranks' environment will hold where it matters to an import (OMP_NUM_THREADS);
        # the call brings the whole of it.
        env = {**rank_defaults, **os.environ, contract.ENV_SPARE: str(os.getpid())}
        return argv, [f"{key}={value}" for key, value in env.items()]

    def _restart_idle_timer_locked(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = threading.Timer(IDLE_TIMEOUT_S, self.drop)
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _drop_locked(self) -> None:
        spares, self._spares = self._spares, []
        self._started_with = None
        with self._zygote_lock:
            self._zygote, self._zygote_command = None, None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        del spares  # each one's keeper kills it, and is reaped, as it is dropped


class KeptRanks:
    """The ranks that one function's calls keep alive between them (keep_alive=True): after a
    call that ended well, its ranks in rank order, waiting for the next call. They end after
    IDLE_TIMEOUT_S unused, with fanrun.cooldown(), with the function, and with the caller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: list = []
        self._key: tuple | None = None
        self._idle_timer: threading.Timer | None = None
        _ALL_KEPT.add(self)

    def take(self, key: tuple) -> list:
        """The kept ranks, if they were kept for a call like this one and every one still waits."""
        with self._lock:
            ranks, self._ranks = self._ranks, []
            if self._key != (key, _starting_point()) or not all(rank.waiting() for rank in ranks):
                ranks = []  # dropped: each one's keeper ends it
            return ranks

    def keep(self, key: tuple, ranks: list) -> None:
        """`key`: what the next call must share with this one to take these ranks (its plan)."""
        with self._lock:
            self._ranks, self._key = ranks, (key, _starting_point())
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer = threading.Timer(IDLE_TIMEOUT_S, _drop_if_alive, args=(weakref.ref(self),))
            self._idle_timer.daemon = True
            self._idle_timer.start()

    def drop(self) -> None:
        with self._lock:
            self._ranks = []
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

    def pids(self) -> list[int]:
        with self._lock:
            return [rank.pid for rank in self._ranks if rank.waiting()]


def _drop_if_alive(kept: weakref.ref) -> None:
    ranks = kept()
    if ranks is not None:
        ranks.drop()


# Every function's kept ranks, for fanrun.cooldown(); a function that is gone takes its own along.
_ALL_KEPT: weakref.WeakSet[KeptRanks] = weakref.WeakSet()


def drop_all_kept() -> None:
    for kept in list(_ALL_KEPT):
        kept.drop()


def kept_pids() -> list[int]:
    return [pid for kept in list(_ALL_KEPT) for pid in kept.pids()]


def _starting_point() -> tuple:
    """What a spare's imports depend on. A package installed or removed changes its directory's
    modification time. The caller's own directories (its working directory, its script's) are
    left out: a notebook writes files there all the time, and spares never import from them."""
    own = {os.path.abspath(entry) for entry in ("", _main_directory()) if entry is not None}
    stamps = []
    for entry in sys.path:
        if os.path.abspath(entry) in own:
            stamps.append("own")
            continue
        try:
            stamps.append(os.stat(entry or ".").st_mtime_ns)
        except OSError:
            stamps.append(None)
    return sys.executable, tuple(sys.path), tuple(stamps), os.getcwd(), tuple(sorted(os.environ.items()))


def _main_directory() -> str | None:
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.dirname(main_file) if main_file else None


def warm(option: bool | None, world_size: int, repeatable: bool) -> bool:
    """Whether a call with @distributed(warm=option) uses spares. `repeatable`: the call is one
    of a function that its process may call again (the decorator's), not a one-off program's."""
    if option is not None:
        return option
    setting = os.environ.get(ENV_WARM, "")
    if setting:
        return setting != "0"
    return POOL.warmed_up or (repeatable and usable_cores() >= WARM_CORES_PER_RANK * world_size)


POOL = SparePool()


def _drop_everything_at_exit() -> None:
    """The spares and the kept ranks end with the interpreter, stopped and reaped here by their
    keepers rather than by their parent-death signal afterwards; and no engine object outlives
    the engine's module, which nanobind would report as leaked on the way out."""
    POOL.drop()
    drop_all_kept()


atexit.register(_drop_everything_at_exit)
