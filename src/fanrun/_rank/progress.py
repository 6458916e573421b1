"""A rank's progress, observed without a change to its code, and its evidence when it stalls.

Progress: once torch is imported, four things that training code already does are timed:
the optimizer's steps (torch's global step post-hook), a DataLoader's batches (its iterators'
__next__), the collectives of torch.distributed's Python functions, and, once
torch.distributed.checkpoint is imported, its save() and async_save() (how long they hold the
training thread, and the step of the last save that completed). Each rewrites this rank's
progress record (the contract's PROGRESS_FORMAT) in a file the rank keeps mapped: a store to
memory, read by the caller's stall watch (_launch/stall_watch.py) whenever it looks. A rank whose
every thread is stuck can still be read, as the record lies in the page cache, not in the rank.
The worker marks when the function began, returned or raised (mark()); with the first collective
or step, the record is "ready". The caller's goodput ledger (_launch/goodput.py) reads these marks.

Evidence, when the caller asks for it on this rank's FIFO: the main thread's frames, the last
collectives of torch's flight recorder and, a moment later, every thread's Python stack, which a
thread of this rank writes. That thread needs the GIL: a rank whose native code holds it cannot answer,
which is itself the evidence, and the caller then signals FORENSICS_SIGNAL, on which faulthandler
writes every thread's stack into the rank's stacks file without the GIL. Only then: faulthandler
reads the threads unlocked, which crashes the rank where one of them runs Python meanwhile.

Run as a file by the worker, like the worker itself: standard library only; torch is never
imported here.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import json
import mmap
import os
import runpy
import struct
import sys
import threading
import time
import traceback

_contract = runpy.run_path(os.path.join(os.path.dirname(__file__), "contract.py"))
_call_after_import = runpy.run_path(os.path.join(os.path.dirname(__file__), "after_import.py"))["call_after_import"]
_FORMAT = struct.Struct(_contract["PROGRESS_FORMAT"])
_FIELD = {name: index for index, name in enumerate(_contract["PROGRESS_FIELDS"])}
_COMPUTE, _DATA, _COLLECTIVE = _contract["STATE_COMPUTE"], _contract["STATE_DATA"], _contract["STATE_COLLECTIVE"]
# Looked up once: each step and collective checks whether it is the first to end ("ready": set-up,
# CUDA, NCCL, the process group, is behind), which costs it a list index and no more.
_READY_AT, _READY_DATA_S, _DATA_S = _FIELD["ready_at"], _FIELD["ready_data_s"], _FIELD["data_s"]

# torch.distributed's collectives that user code calls; each one entered counts once (the ones
# that others call inside, as all_gather_object calls all_gather, are not counted again).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
               "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
               "scatter_object_list", "send")
# How many of the flight recorder's last entries a rank's evidence holds.
EVIDENCE_COLLECTIVES = 16
# How many frames of each thread it holds, innermost first: faulthandler's bound, read the same way.
STACK_FRAMES = 100
# How far apart its two looks at the main thread are: ten of the interpreter's switch intervals.
LOOKS_APART_S = 0.05

_record: _Record | None = None  # this call's record; a kept rank gets a new one each call
_patched = False
_checkpoint_patched = False
CHECKPOINT_MODULE = "torch.distributed.checkpoint"


class _Record:
    """The mapped progress record and the values it holds, kept here too so that an update
    packs the whole record at once (one pack_into, about a microsecond)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _FORMAT.size)
            self._map = mmap.mmap(fd, _FORMAT.size)
        finally:
            os.close(fd)
        self.values = [0.0] * len(_FIELD)
        for name in ("steps", "batches", "collectives", "checkpoint_step", "checkpoints"):
            self.values[_FIELD[name]] = 0
        self.values[_FIELD["magic"]], self.values[_FIELD["op"]] = _contract["PROGRESS_MAGIC"], b""
        self.values[_FIELD["state"]], self.values[_FIELD["pid"]] = _COMPUTE, os.getpid()
        self.values[_FIELD["state_since"]] = time.time()
        self.depth = 0  # collectives inside a collective are not counted
        self.saving = False  # a save inside a save (async_save's own) is not counted again
        self.step_data_from = self.step_comm_from = 0.0  # data_s and comm_s when the last step ended
        self.write()

    def write(self) -> None:
        _FORMAT.pack_into(self._map, 0, *self.values)

    def close(self) -> None:
        self._map.close()


def install(run_dir: str, rank: int) -> None:
    """Starts this call's record, stacks file and forensics thread, and times torch once it is imported."""
    global _record
    if _record is not None:
        _record.close()
    else:
        # A process forked from the rank (a DataLoader's worker) shares the mapping: its writes
        # would be the rank's.
        os.register_at_fork(after_in_child=_forget_record)
    _record = _Record(os.path.join(run_dir, _contract["progress_name"](rank)))
    _Forensics.start(run_dir, rank)
    _call_after_import("torch", _patch_torch)


def mark(field: str) -> None:
    """The worker's marks: the function began (began_at), returned (ended_at) or raised (failed_at)."""
    record = _record
    if record is not None:
        record.values[_FIELD[field]] = time.time()
        record.write()


def _forget_record() -> None:
    global _record
    _record = None


def _patch_torch() -> None:
    """Times torch's steps, batches and collectives, once per process: a kept rank's later calls
    find them timed already, and write to their own record."""
    global _patched
    if _patched:
        return
    _patched = True
    if _record is not None:
        _record.values[_FIELD["torch_at"]] = time.time()  # the ledger counts the import as the start's
        _record.write()
    # Imported by the function only when it saves; importing it here would cost every rank.
    _call_after_import(CHECKPOINT_MODULE, _patch_checkpoint)
    try:
        importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook(_stepped)
    except (ImportError, AttributeError):
        pass  # a torch without global optimizer hooks: no steps, the rest still tells
    try:
        iterator = importlib.import_module("torch.utils.data.dataloader")._BaseDataLoaderIter
        iterator.__next__ = _timed_next(iterator.__next__)
    except (ImportError, AttributeError):
        pass
    try:
        distributed = importlib.import_module("torch.distributed")
        c10d = importlib.import_module("torch.distributed.distributed_c10d")
    except ImportError:
        return  # a torch built without distributed
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        timed = _timed_collective(name, original)
        setattr(c10d, name, timed)
        if getattr(distributed, name, None) is original:
            setattr(distributed, name, timed)


def _stepped(optimizer, args, kwargs) -> None:
    record = _record
    if record is None:
        return
    values, now = record.values, time.time()
    if values[_FIELD["steps"]]:
        values[_FIELD["step_s"]] = now - values[_FIELD["step_at"]]
        values[_FIELD["step_data_s"]] = values[_FIELD["data_s"]] - record.step_data_from
        values[_FIELD["step_comm_s"]] = values[_FIELD["comm_s"]] - record.step_comm_from
    record.step_data_from, record.step_comm_from = values[_FIELD["data_s"]], values[_FIELD["comm_s"]]
    values[_FIELD["steps"]] += 1
    values[_FIELD["step_at"]] = values[_FIELD["progress_at"]] = now
    if not values[_READY_AT]:
        values[_READY_AT], values[_READY_DATA_S] = now, values[_DATA_S]
    record.write()


def _timed_next(next_batch):
    @functools.wraps(next_batch)
    def timed_next(self):
        record = _record
        if record is None or record.depth:
            return next_batch(self)
        values = record.values
        started = time.time()
        values[_FIELD["state"]], values[_FIELD["state_since"]] = _DATA, started
        record.write()
        try:
            return next_batch(self)
        finally:
            now = time.time()
            values[_FIELD["data_s"]] += now - started
            values[_FIELD["batches"]] += 1
            values[_FIELD["state"]], values[_FIELD["state_since"]] = _COMPUTE, now
            values[_FIELD["progress_at"]] = now
            record.write()

    return timed_next


def _timed_collective(name: str, collective):
    op = name.encode()

    @functools.wraps(collective)
    def timed_collective(*args, **kwargs):
        record = _record
        if record is None or record.depth:
            return collective(*args, **kwargs)
        values = record.values
        started = time.time()
        values[_FIELD["collectives"]] += 1
        values[_FIELD["state"]], values[_FIELD["state_since"]], values[_FIELD["op"]] = _COLLECTIVE, started, op
        record.write()
        record.depth += 1
        try:
            result = collective(*args, **kwargs)
        finally:
            record.depth -= 1
        # Not reached when it raised: the record still names the collective that failed, for the
        # report of the call's failure (_launch/failure_peers.py).
        now = time.time()
        values[_FIELD["comm_s"]] += now - started
        values[_FIELD["state"]], values[_FIELD["state_since"]] = _COMPUTE, now
        values[_FIELD["progress_at"]] = now
        if not values[_READY_AT]:
            values[_READY_AT], values[_READY_DATA_S] = now, values[_DATA_S]
        record.write()
        return result

    return timed_collective


def _patch_checkpoint() -> None:
    """Times torch.distributed.checkpoint's save() and async_save(), whatever the storage
    (fanrun's VolumeWriter or another), once per process."""
    global _checkpoint_patched
    if _checkpoint_patched:
        return
    _checkpoint_patched = True
    modules = [sys.modules.get(CHECKPOINT_MODULE), sys.modules.get(f"{CHECKPOINT_MODULE}.state_dict_saver")]
    for name in ("save", "async_save"):
        original = getattr(modules[0], name, None)
        if original is None:
            continue
        timed = _timed_save(original, waits_for_save=name == "save")
        for module in modules:
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, timed)


def _timed_save(save, waits_for_save: bool):
    """The time a save holds the calling thread counts as a checkpoint stall: all of save(), the
    staging part of async_save(). The save is complete when save() returns, or when
    async_save()'s future of the upload is done; its step is the steps done when it began."""

    @functools.wraps(save)
    def timed_save(*args, **kwargs):
        record = _record
        if record is None or record.saving:
            return save(*args, **kwargs)
        values = record.values
        steps, started = values[_FIELD["steps"]], time.time()
        record.saving = True
        try:
            result = save(*args, **kwargs)
        finally:
            record.saving = False
            values[_FIELD["checkpoint_s"]] += time.time() - started
            record.write()
        if waits_for_save:
            _saved(record, steps)
        else:
            upload = getattr(result, "upload_completion", result)  # an AsyncSaveResponse, or the future itself
            if hasattr(upload, "add_done_callback"):
                upload.add_done_callback(lambda future: _completed(future) and _saved(record, steps))
        return result

    return timed_save


def _completed(future) -> bool:
    try:
        (future.result if hasattr(future, "result") else future.value)()
    except BaseException:
        return False
    return True


def _saved(record: _Record, steps: int) -> None:
    """A save that began after `steps` steps has completed (in the save's thread, for an async one)."""
    if record is not _record:
        return  # a kept rank's next call has a record of its own
    values = record.values
    values[_FIELD["checkpoint_step"]] = max(values[_FIELD["checkpoint_step"]], steps)
    values[_FIELD["checkpoints"]] += 1
    record.write()


class _Forensics:
    """This call's stacks file, registered with faulthandler, and the thread that answers its FIFO."""

    current: _Forensics | None = None

    def __init__(self, run_dir: str, rank: int) -> None:
        self._answer = os.path.join(run_dir, _contract["forensics_answer_name"](rank))
        self._collectives = os.path.join(run_dir, _contract["forensics_collectives_name"](rank))
        stacks = os.path.join(run_dir, _contract["forensics_stacks_name"](rank))
        self._stacks = open(os.open(stacks, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                                    0o600), "wb", buffering=0)
        ask = os.path.join(run_dir, _contract["forensics_ask_name"](rank))
        os.mkfifo(ask, 0o600)
        # Read and write: opening never waits for a writer, and a read never sees an end.
        self._ask_fd = os.open(ask, os.O_RDWR | os.O_CLOEXEC)
        self._main = threading.main_thread().ident

    @classmethod
    def start(cls, run_dir: str, rank: int) -> None:
        if cls.current is not None:
            cls.current.stop()
        forensics = cls.current = cls(run_dir, rank)
        faulthandler.register(_contract["FORENSICS_SIGNAL"], file=forensics._stacks, all_threads=True, chain=False)
        threading.Thread(target=forensics._answer_asks, name="fanrun-forensics", daemon=True).start()

    def stop(self) -> None:
        os.write(self._ask_fd, _contract["FORENSICS_ASK_STOP"])  # the thread closes its FIFO when it reads this

    def _answer_asks(self) -> None:
        with os.fdopen(self._ask_fd, "rb", buffering=0) as asks, self._stacks:
            while True:
                line = asks.readline()
                if not line or line == _contract["FORENSICS_ASK_STOP"]:
                    return
                try:
                    if line == _contract["FORENSICS_ASK_COLLECTIVES"]:
                        self._write_collectives()
                    else:
                        self._write_evidence()
                except Exception as error:  # evidence is best effort: the stacks file still has the stacks
                    # No time: never taken for an answer, so the rank's silence leads to its stacks file.
                    _write_json(self._answer, {"error": f"{type(error).__name__}: {error}"})

    def _write_collectives(self) -> None:
        """Every collective the flight recorder holds, for the straggler watch: who starts each one
        last. No stack: asked every few seconds, it costs the rank one dump of the recorder."""
        _write_json(self._collectives, {"time": time.time(), "collectives": _flight_recorder(None)})

    def _write_evidence(self) -> None:
        main = sys._current_frames().get(self._main)
        stack = [[f.filename, f.lineno, f.name] for f in traceback.extract_stack(main)] if main else []
        collectives = _flight_recorder()
        # A second look, with the GIL given up between: a main thread that runs Python has moved
        # by then, one in a native call has not (the launcher's verdict tells them apart so).
        time.sleep(LOOKS_APART_S)
        stacks = _every_stack(sys._current_frames(), self._main)
        _write_json(self._answer, {"time": time.time(), "main_stack": stack, "stacks": stacks, "collectives": collectives})


def _write_json(path: str, value: dict) -> None:
    """Whole or not at all: the caller reads it at any time."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(value, out)
    os.replace(tmp, path)


def _every_stack(frames: dict, main: int | None) -> str:
    """Every thread's stack but this one's, as faulthandler writes them (innermost frame first, at
    most STACK_FRAMES, the main thread last), read under the GIL: faulthandler's own dump, from a
    signal handler, reads the threads without it and crashes the rank when one of them runs Python."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    order = [ident for ident in frames if ident not in (me, main)] + ([main] if main in frames else [])
    out = []
    for ident in order:
        lines = [f"Thread 0x{ident:016x} [{names.get(ident, '?')}] (most recent call first):"]
        frame = frames[ident]
        while frame is not None and len(lines) <= STACK_FRAMES:
            code = frame.f_code
            line = "???" if frame.f_lineno is None else frame.f_lineno
            lines.append(f'  File "{code.co_filename}", line {line} in {code.co_name}')
            frame = frame.f_back
        if frame is not None:
            lines.append("  ...")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _flight_recorder(last: int | None = EVIDENCE_COLLECTIVES) -> list[dict] | None:
    """The `last` collectives torch's flight recorder holds (seq, op, state, when created, whether
    retired: done, even where the state says nothing of it, as gloo's "scheduled" does; None: all it
    holds); None where torch is not imported or keeps no record (TORCH_FR_BUFFER_SIZE unset or 0)."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        return None
    try:
        entries = json.loads(dump(includeCollectives=True)).get("entries", [])
    except Exception:
        return None
    return [{"seq": entry.get("collective_seq_id"), "op": entry.get("profiling_name"), "state": entry.get("state"),
             "created_ns": entry.get("time_created_ns"), "group": (entry.get("process_group") or [None])[0],
             "retired": entry.get("retired")}
            for entry in entries[-last if last is not None else 0:]]
