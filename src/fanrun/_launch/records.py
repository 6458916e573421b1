"""Run records: one for every run, blocking or detached, from any door, each in a directory of
its own under <runs root>/records, private to its user (0700, like the runs root above it). The
directory's name is the run's id, the one it is known by everywhere: printed as it starts, and
taken by `fanrun stacks`, `list`, `logs`, `attach`, `cancel`, fanrun.Run and fanrun.runs().

A record is written once and added to, never rewritten (its files: record_files.py): each file is
made whole under a name of its own and linked into place (_private_dir.create_private), so that
its end is recorded once, by whoever ends it first, and a blocking call rewrites no file (ext4
flushes a file that replaces another: a millisecond each). read_state() gives the whole record as
one dict: state.json's fields, then the attempts' (status RUNNING, started, run_dir, run_dirs),
then the end's.

A record whose files cannot be read as fanrun writes them (not JSON, not its fields, a link, a
file where a directory should be) is damaged: reading it raises DamagedRunError, which names what
is wrong, and the other records are read as ever.

A record that has not ended but whose runner is gone (or no longer holds it) is ended FAILED, with
the reason, by whoever reads it first: a crash at any point, a caller killed by SIGKILL included,
never leaves a run that claims to run. A run of a Ray job (_detached/ray_job.py) is the cluster's
to tell, until it has ended.

Each new record prunes the records beyond the newest KEEP_RECORDS that have ended, so that a
notebook calling 10,000 times keeps 100 (in a thread, which the call does not wait for): never
one whose runner holds it, never a damaged one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .._errors import FanrunError, UnknownRunError
from .._private_dir import create_private, open_private, open_private_subdir, replace_private
from .._spec.paths import open_run_directory, open_runs_root
from .record_files import (ATTEMPT, BLOCKING, DETACHED, END, FAILED, FINAL, FINISHED, KILLED, MAKING, QUEUED,
                           RUN_ID, RUNNER, RUNNING, STATE, DamagedRunError, attempt_name, check_attempt,
                           check_end, check_runner, check_state, hold_runner, made_at, make_directory,
                           not_a_directory, process_start, write_new)

FOLDER = "records"
# Records that have ended beyond the newest this many are removed when a new one is made.
KEEP_RECORDS = 100
# The errors of a disk (or a quota) that has no room left.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
# A run that has no runner on record yet is still being started, for this long at most.
STARTING_S = 60.0
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REMEDY = "Remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a directory of your own."


def root() -> tuple[Path, int]:
    """The folder of the records and a descriptor of it, made private where missing."""
    runs_root, runs_fd = open_runs_root()
    try:
        fd = open_private_subdir(runs_fd, FOLDER, str(runs_root), what="fanrun's run records directory",
                                 remedy=_REMEDY)
    finally:
        os.close(runs_fd)
    return runs_root / FOLDER, fd


class RunRecord:
    """The record of one run, in its directory; `id` is the run's id."""

    def __init__(self, directory: Path, kind: str | None = None) -> None:
        self.directory = directory
        self.id = directory.name
        self._kind = kind  # read from state.json where it is needed, and not known yet
        self._attempts: int | None = None  # the attempts recorded, where this process counted them
        self._hold = -1  # runner.json, locked, while this process runs the call (create(owner=True), own())

    # ------------------------------------------------------------ making and finding

    @classmethod
    def create(cls, name: str, *, kind: str, world_size: int | None, owner: bool, **fields: object) -> RunRecord:
        """A new record, QUEUED, with `fields` in its state.json (a Ray job's cluster); with
        `owner`, this process is its runner from now on. Records beyond the newest KEEP_RECORDS
        that have ended are pruned."""
        parent, parent_fd = root()
        try:
            making, run_id = make_directory(parent_fd, name)
            record = cls(parent / run_id, kind)
            record._attempts = 0
            dir_fd = os.open(making, _DIRECTORY_FLAGS, dir_fd=parent_fd)
            try:
                os.fchmod(dir_fd, 0o700)  # whatever the umask
                if owner:
                    record._hold = hold_runner(dir_fd, seen=False)
                state = {"status": QUEUED, "kind": kind, "name": name, "created": time.time(), **fields}
                if world_size is not None:
                    state["world_size"] = world_size
                write_new(dir_fd, STATE, json.dumps(state).encode(), sync=record._durable())
                os.rename(making, run_id, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            except BaseException:
                record.release()
                shutil.rmtree(making, dir_fd=parent_fd, ignore_errors=True)
                raise
            finally:
                os.close(dir_fd)
            _prune_soon(parent, parent_fd)
            return record
        finally:
            os.close(parent_fd)

    @classmethod
    def find(cls, run_id: str) -> RunRecord:
        """The record of the run `run_id`; UnknownRunError where this user has none of that id."""
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise UnknownRunError(f"{run_id!r} is not a run id (a run id looks like train-20261201-140512-a3f9c1, "
                                  f"as the run printed when it started; `fanrun list --all` shows yours)")
        parent, parent_fd = root()
        os.close(parent_fd)
        record = cls(parent / run_id)
        try:
            record._check_directory()
        except UnknownRunError:
            raise UnknownRunError(f"no run {run_id} in {parent} (`fanrun list --all` shows your runs)") from None
        return record

    def own(self) -> None:
        """This process runs the call from now on (a detached run's runner, once it has started);
        FanrunError where the run has ended already (a runner so slow to start that a reader
        ended it FAILED)."""
        with self._opened() as dir_fd:
            self._hold = hold_runner(dir_fd, seen=True)
        state = self.read_state() or {}
        if state.get("status") in FINAL:
            self.release()
            raise FanrunError(f"run {self.id} ended {state['status']} before its runner started: {state.get('reason')}")

    def release(self) -> None:
        """This process no longer runs the call: from now on, the record may be pruned."""
        if self._hold >= 0:
            os.close(self._hold)
            self._hold = -1

    def remove_unstarted(self) -> None:
        """A record made for a submission that another with its idempotency key preceded."""
        self.release()
        for name in os.listdir(self.directory):
            os.unlink(self.directory / name)
        os.rmdir(self.directory)

    # ------------------------------------------------------------ the run's course

    def attempt(self, run_dir: Path) -> None:
        """An attempt of the call runs in `run_dir`, its GPUs held: RUNNING from now on. On a full
        disk the record stays as it was, and the run goes on."""
        with self._opened() as dir_fd:
            if self._attempts is None:
                self._attempts = sum(1 for name in os.listdir(dir_fd) if ATTEMPT.fullmatch(name))
            attempt = {"run_dir": str(run_dir), "started": time.time()}
            try:
                create_private(dir_fd, attempt_name(self._attempts), json.dumps(attempt).encode(),
                               sync=self._durable())
            except OSError as error:
                if error.errno not in NO_ROOM:
                    raise
            self._attempts += 1

    def end(self, status: str, reason: str = "") -> bool:
        """Records the run's end; False where another was recorded first (a reader that found the
        runner gone), which stays."""
        end = {"status": status, "ended": time.time(), "reason": reason}
        try:
            with self._opened() as dir_fd:
                create_private(dir_fd, END, json.dumps(end).encode(), sync=self._durable())
        except FileExistsError:
            return False
        return True

    # ------------------------------------------------------------ reading it

    def state(self) -> dict:
        """The run's state; a run whose runner has ended, or no longer holds it, without a final
        state is marked FAILED (on disk where it can be written: a reader on a full disk still
        gets it). DamagedRunError where state.json or runner.json is not as fanrun writes it."""
        self._check_directory()
        current = self.read_state() or {"status": FAILED, "reason": "its state file is missing"}
        if current["status"] in FINAL or "ray_job" in current:  # a Ray job's is the cluster's to tell (ray_job.py)
            return current
        reason = self._why_not_running(current)
        if reason is None:
            return current
        try:
            self.end(FAILED, reason)  # unless the runner, or another reader, recorded an end just before
        except OSError:
            # A full or read-only disk: the next reader marks it.
            return {**current, "status": FAILED, "reason": reason, "ended": time.time()}
        return self.read_state() or current

    def _why_not_running(self, current: dict) -> str | None:
        """None while the runner runs the call (or, for a while, is being started); else why it does not."""
        who = "its caller" if current.get("kind") == BLOCKING else "its runner"
        runner = self.read_runner()
        if runner is None:
            if time.time() - current.get("created", 0) < STARTING_S:
                return None  # being started
            return f"{who} never started"
        if process_start(runner["pid"]) != runner["start"]:
            return f"{who} (pid {runner['pid']}) ended without recording an outcome"
        if not self._held():
            return f"{who} (pid {runner['pid']}) no longer runs it, and recorded no outcome"
        return None

    def _held(self) -> bool:
        """Whether a process holds runner.json locked: the one that runs the call."""
        if self._hold >= 0:
            return True
        with self._opened() as dir_fd:
            try:
                fd = open_private(dir_fd, RUNNER, os.O_RDONLY)
            except FileNotFoundError:
                return False
        try:
            # Shared, so that two readers asking at once never take each other for the runner.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def read_state(self) -> dict | None:
        """The record as it is on disk, as one dict: state.json's fields, then its attempts' (status
        RUNNING, started, run_dir, run_dirs), then its end's. Each file is checked (DamagedRunError
        where one is not as fanrun writes it); None where state.json is missing."""
        state = self._read_checked(STATE, check_state)
        if state is None:
            return None
        try:
            with self._opened() as dir_fd:
                names = os.listdir(dir_fd)
        except OSError as error:
            raise DamagedRunError(f"its directory cannot be listed: {error}") from None
        numbered = sorted((int(found.group(1)), name) for name in names if (found := ATTEMPT.fullmatch(name)))
        attempts = [self._read_checked(name, check_attempt) for _, name in numbered]
        if attempts:
            state.update(status=RUNNING, started=attempts[0]["started"], run_dir=attempts[-1]["run_dir"],
                         run_dirs=[attempt["run_dir"] for attempt in attempts])
        end = self._read_checked(END, check_end) if END in names else None
        if end is not None:
            state.update(end)
        return state

    def read_runner(self) -> dict | None:
        """runner.json, checked as state.json is."""
        return self._read_checked(RUNNER, check_runner)

    def run_directory(self, path: str | None = None) -> tuple[Path, int] | None:
        """The run directory of the latest attempt (or `path`, one of run_dirs) and a descriptor
        of it, which the caller closes: only a run directory of the runs root, never another
        place that the record names; None where there is none (yet, or any more)."""
        path = path or (self.read_state() or {}).get("run_dir")
        return open_run_directory(path) if path else None

        # ------------------------------------------------------------ its files

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replaces `name` atomically, synced: a reader sees the old file or the new one, never a part."""
        with self._opened() as dir_fd:
            replace_private(dir_fd, name, data)

    def add(self, name: str, data: bytes) -> None:
        """Adds the file `name` to the record, once (the call's goodput ledger, goodput.py)."""
        with self._opened() as dir_fd:
            create_private(dir_fd, name, data, sync=self._durable())

    def read_bytes(self, name: str) -> bytes | None:
        with self._opened() as dir_fd:
            try:
                fd = open_private(dir_fd, name, os.O_RDONLY)
            except FileNotFoundError:
                return None
        with os.fdopen(fd, "rb") as file:
            return file.read()

    def open_file(self, name: str, flags: int) -> int:
        """A file of the record, opened as _private_dir.open_private opens one."""
        with self._opened() as dir_fd:
            return open_private(dir_fd, name, flags)

    @contextlib.contextmanager
    def _opened(self) -> Iterator[int]:
        dir_fd = os.open(self.directory, _DIRECTORY_FLAGS)
        try:
            yield dir_fd
        finally:
            os.close(dir_fd)

    def _durable(self) -> bool:
        """Whether the record's files are synced as they are written: a detached run's, which must
        outlive a crash of the machine; not a blocking call's, which such a crash ends with its
        caller, and whose record costs the call nothing it could measure."""
        if self._kind is None:
            try:
                self._kind = (self._read_checked(STATE, check_state) or {}).get("kind", DETACHED)
            except DamagedRunError:
                self._kind = DETACHED
        return self._kind != BLOCKING

    def _check_directory(self) -> None:
        """DamagedRunError where the record's name is a file or a link; UnknownRunError where it is gone."""
        try:
            os.close(os.open(self.directory, _DIRECTORY_FLAGS))
        except FileNotFoundError:
            raise UnknownRunError(f"run {self.id} is gone from {self.directory.parent}") from None
        except OSError as error:
            raise DamagedRunError(f"{self.directory} is {not_a_directory(self.directory, error)}, not a run's "
                                  f"directory; remove it if it is not yours to keep") from None

    def _read_checked(self, name: str, check) -> dict | None:
        try:
            data = self.read_bytes(name)
        except (FanrunError, OSError) as error:  # a link, a directory, another user's file
            raise DamagedRunError(f"its {name} cannot be read: {error}") from None
        if data is None:
            return None
        try:
            value = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise DamagedRunError(f"its {name} is not JSON ({len(data)} bytes)") from None
        why = check(value) if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"
        if why is not None:
            raise DamagedRunError(f"its {name} is damaged: {why}")
        return value

    def __repr__(self) -> str:
        return f"RunRecord({str(self.directory)!r})"


@contextlib.contextmanager
def of_call(name: str, world_size: int, given: RunRecord | None = None) -> Iterator[RunRecord]:
    """The record of a call: `given`, a detached run's, which its runner ends; else one made here,
    run by this process, and ended with the call: FINISHED, FAILED with its reason's first line,
    or KILLED by an interrupt or SIGTERM. Its end never hides the call's outcome."""
    if given is not None:
        yield given
        return
    record = RunRecord.create(name, kind=BLOCKING, world_size=world_size, owner=True)
    try:
        try:
            yield record
        except Exception as error:
            _end(record, FAILED, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}")
            raise
        except BaseException as error:  # KeyboardInterrupt, or SystemExit (`fanrun run`'s on SIGTERM: 143)
            stopped = f"stopped (SystemExit {error.code})" if isinstance(error, SystemExit) else \
                f"stopped ({type(error).__name__})"
            _end(record, KILLED, "interrupted" if isinstance(error, KeyboardInterrupt) else stopped)
            raise
        _end(record, FINISHED)
    finally:
        record.release()


def _end(record: RunRecord, status: str, reason: str = "") -> None:
    try:
        record.end(status, reason)
    except (OSError, FanrunError) as error:
        # The call's outcome is the caller's, whatever its record: a reader marks it FAILED.
        print(f"fanrun: run {record.id} ended {status}, which its record could not keep: {error}",
              file=sys.stderr, flush=True)


def all_records() -> list[RunRecord]:
    """Every run's record, oldest first."""
    parent, parent_fd = root()
    try:
        names = [name for name in os.listdir(parent_fd) if RUN_ID.fullmatch(name)]
    finally:
        os.close(parent_fd)
    return [RunRecord(parent / name) for name in sorted(names, key=made_at)]


def _prune_soon(parent: Path, parent_fd: int) -> None:
    """Prunes the folder in this process's pruning thread: removing a record costs a busy disk
    milliseconds (the file system frees its files), which the call that made it does not wait
    for; its ranks start meanwhile. Several records made while it prunes are pruned once, after."""
    _PRUNER.soon(parent, parent_fd)


def pruned() -> None:
    """Returns once the pruning that this process asked for is done."""
    _PRUNER.done()


class _Pruner:
    """One thread, started by the first record a process makes, that prunes as it is asked."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._asked: tuple[Path, int] | None = None  # the folder, and a descriptor of it that the thread closes
        self._busy = False
        self._thread: threading.Thread | None = None
        # A child forked by the caller's own code has no thread, and may have been forked while
        # the thread held the lock: it starts afresh.
        os.register_at_fork(after_in_child=self.__init__)

    def soon(self, parent: Path, parent_fd: int) -> None:
        fd = os.dup(parent_fd)  # the folder that root() checked, not its path again
        with self._changed:
            if self._asked is not None:
                os.close(self._asked[1])
            self._asked = (parent, fd)
            if self._thread is None or not self._thread.is_alive():  # the first, or the first since a fork
                self._busy = False
                self._thread = threading.Thread(target=self._run, name="fanrun-prune-records", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def done(self) -> None:
        with self._changed:
            while self._asked is not None or self._busy:
                self._changed.wait()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._busy = False
                self._changed.notify_all()
                while self._asked is None:
                    self._changed.wait()
                (parent, fd), self._asked, self._busy = self._asked, None, True
            try:
                _prune(parent, fd, KEEP_RECORDS)
            except OSError:
                pass  # the folder is gone or unreadable now: the next record's pruning tries again
            finally:
                os.close(fd)


_PRUNER = _Pruner()


def _prune(parent: Path, parent_fd: int, keep: int) -> None:
    """Removes the records that have ended beyond the newest `keep`, and records left half made
    (their maker gone) for longer than STARTING_S; nothing else is touched."""
    names = os.listdir(parent_fd)
    records = sorted((name for name in names if RUN_ID.fullmatch(name)), key=made_at)
    for name in records[: max(0, len(records) - keep)]:
        _remove_if_ended(parent, parent_fd, name)
    for name in names:
        if MAKING.fullmatch(name):
            _remove_if_abandoned(parent_fd, name)


def _remove_if_ended(parent: Path, parent_fd: int, name: str) -> None:
    try:
        dir_fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent_fd)
    except OSError:
        return  # removed meanwhile by another pruner, a link, or not a directory
    try:
        if os.fstat(dir_fd).st_uid != os.geteuid():
            return
        try:
            if RunRecord(parent / name).state()["status"] not in FINAL:
                return
        except (FanrunError, OSError):
            return  # damaged: not fanrun's to remove
        try:
            hold = open_private(dir_fd, RUNNER, os.O_RDWR)
        except FileNotFoundError:
            hold = -1
        except OSError:
            return  # a link, another user's: not as fanrun writes it
        try:
            if hold >= 0:
                try:
                    fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # its runner still holds it (a detached run's, giving its readers the end)
            # The lock is held while removing: another pruner finds it locked, or gone.
            shutil.rmtree(name, dir_fd=parent_fd, ignore_errors=True)
        finally:
            if hold >= 0:
                os.close(hold)
    finally:
        os.close(dir_fd)


def _remove_if_abandoned(parent_fd: int, name: str) -> None:
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return
    if info.st_uid == os.geteuid() and time.time() - info.st_mtime > STARTING_S and stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=parent_fd, ignore_errors=True)


