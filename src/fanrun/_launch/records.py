"""Run records: one for every run, blocking or detached, from any door, each in a directory of
its own under <runs root>/records, private to its user (0700, like the runs root above it). The
directory's name is the run's id, the one it is known by everywhere: printed as it starts, and
taken by `fanrun stacks`, `list`, `logs`, `attach`, `cancel`, fanrun.Run and fanrun.runs().

A record is written once and added to, never rewritten: each file is made whole under a name of
its own and linked into place (_private_dir.create_private), so that its end is recorded once, by
whoever ends it first, and a blocking call pays for no rewritten file:

    state.json    written as the record is made: QUEUED, its kind (blocking or detached), name,
                  world size, when it was made (created), and a Ray job's cluster
    attempt-N.json  each attempt (N from 0), once its GPUs are held: its run directory
                  (_spec/paths.py) and when it started; the run is RUNNING from the first
    end.json      FINISHED, FAILED or KILLED, when (ended), and the reason's first line
    runner.json   the process that runs the call (a blocking call's caller, a detached run's
                  runner): its pid and start time, which tell it from a later process with its
                  pid. That process holds it locked (flock) for as long as it runs the call
    outcome.pkl   a detached run's results, or the exception a blocking call would have raised

A detached run's record also holds what only a detached run has (_detached/files.py). read_state()
gives the whole record as one dict: state.json's fields, then the attempts' (status RUNNING,
started, run_dir, run_dirs), then the end's.

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
import datetime
import errno
import fcntl
import json
import os
import re
import secrets
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
from .file_changes import FileChanges

QUEUED, RUNNING, FINISHED, FAILED, KILLED = "QUEUED", "RUNNING", "FINISHED", "FAILED", "KILLED"
FINAL = (FINISHED, FAILED, KILLED)
STATUSES = (QUEUED, RUNNING, *FINAL)
# A blocking call's results go to its caller; a detached run's are kept in its record.
BLOCKING, DETACHED = "blocking", "detached"

FOLDER = "records"
STATE = "state.json"
END = "end.json"
RUNNER = "runner.json"
OUTCOME = "outcome.pkl"
_ATTEMPT = re.compile(r"attempt-(\d{1,6})\.json")
# Records that have ended beyond the newest this many are removed when a new one is made.
KEEP_RECORDS = 100
# The errors of a disk (or a quota) that has no room left.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
# A run that has no runner on record yet is still being started, for this long at most.
STARTING_S = 60.0

# A run's id: the function's name, the time to the second, and a part whose first five hex
# digits are the microseconds (so that the runs of one second sort as they were made) and whose
# last is random.
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,40}-\d{8}-\d{6}-[0-9a-f]{6}")
# A record being made: its files are written before it is renamed to its id, so that no reader
# ever finds one half made.
_MAKING = re.compile(r"\.making-" + _RUN_ID.pattern)
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REMEDY = "Remove it so that fanrun makes it afresh, or set FANRUN_RUNS_DIR to a directory of your own."


class DamagedRunError(FanrunError):
    """A run's record is not as fanrun writes it; the message says what is wrong."""


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
            making, run_id = _make_directory(parent_fd, name)
            record = cls(parent / run_id, kind)
            record._attempts = 0
            dir_fd = os.open(making, _DIRECTORY_FLAGS, dir_fd=parent_fd)
            try:
                os.fchmod(dir_fd, 0o700)  # whatever the umask
                if owner:
                    record._hold = _hold_runner(dir_fd, seen=False)
                state = {"status": QUEUED, "kind": kind, "name": name, "created": time.time(), **fields}
                if world_size is not None:
                    state["world_size"] = world_size
                _write_new(dir_fd, STATE, json.dumps(state).encode(), sync=record._durable())
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
        if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
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
            self._hold = _hold_runner(dir_fd, seen=True)
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
                self._attempts = sum(1 for name in os.listdir(dir_fd) if _ATTEMPT.fullmatch(name))
            attempt = {"run_dir": str(run_dir), "started": time.time()}
            try:
                create_private(dir_fd, f"attempt-{self._attempts}.json", json.dumps(attempt).encode(),
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
        state = self._read_checked(STATE, _check_state)
        if state is None:
            return None
        try:
            with self._opened() as dir_fd:
                names = os.listdir(dir_fd)
        except OSError as error:
            raise DamagedRunError(f"its directory cannot be listed: {error}") from None
        numbered = sorted((int(found.group(1)), name) for name in names if (found := _ATTEMPT.fullmatch(name)))
        attempts = [self._read_checked(name, _check_attempt) for _, name in numbered]
        if attempts:
            state.update(status=RUNNING, started=attempts[0]["started"], run_dir=attempts[-1]["run_dir"],
                         run_dirs=[attempt["run_dir"] for attempt in attempts])
        end = self._read_checked(END, _check_end) if END in names else None
        if end is not None:
            state.update(end)
        return state

    def read_runner(self) -> dict | None:
        """runner.json, checked as state.json is."""
        return self._read_checked(RUNNER, _check_runner)

    def run_directory(self, path: str | None = None) -> tuple[Path, int] | None:
        """The run directory of the latest attempt (or `path`, one of run_dirs) and a descriptor
        of it, which the caller closes: only a run directory of the runs root, never another
        place that the record names; None where there is none (yet, or any more)."""
        path = path or (self.read_state() or {}).get("run_dir")
        return open_run_directory(path) if path else None

    def wait(self, timeout: float | None = None) -> str:
        """Blocks until the run has ended, or `timeout` seconds have passed; returns its status.
        It wakes as the record's files change and as its runner ends, never on a clock."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with FileChanges([], directories=[str(self.directory)]) as changes, _ProcessEnd() as runner_end:
            while True:
                state = self.state()
                if state["status"] in FINAL or "ray_job" in state:
                    return state["status"]
                runner = self.read_runner()
                if runner is not None and not runner_end.follow(runner["pid"], runner["start"]):
                    continue  # it ended just now: the next read marks the run
                left = None if deadline is None else deadline - time.monotonic()
                if runner is None:  # being started: it fails once STARTING_S has passed
                    starting = max(state.get("created", 0) + STARTING_S - time.time(), 0.0) + 0.1
                    left = starting if left is None else min(left, starting)
                if left is not None and left <= 0:
                    return state["status"]
                changes.wait(left, also=runner_end.fds)

    # ------------------------------------------------------------ its files

    def write_json(self, name: str, value: dict) -> None:
        self.write_bytes(name, json.dumps(value).encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replaces `name` atomically, synced: a reader sees the old file or the new one, never a part."""
        with self._opened() as dir_fd:
            replace_private(dir_fd, name, data)

    def read_bytes(self, name: str) -> bytes | None:
        with self._opened() as dir_fd:
            try:
                fd = open_private(dir_fd, name, os.O_RDONLY)
            except FileNotFoundError:
                return None
        with os.fdopen(fd, "rb") as file:
            return file.read()

    def read_json(self, name: str) -> dict | None:
        data = self.read_bytes(name)
        return None if data is None else json.loads(data)

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
                self._kind = (self._read_checked(STATE, _check_state) or {}).get("kind", DETACHED)
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
            raise DamagedRunError(f"{self.directory} is {_not_a_directory(self.directory, error)}, not a run's "
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
        except BaseException as error:  # KeyboardInterrupt, or SystemExit after SIGTERM
            _end(record, KILLED, "interrupted" if isinstance(error, KeyboardInterrupt) else "stopped")
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
        names = [name for name in os.listdir(parent_fd) if _RUN_ID.fullmatch(name)]
    finally:
        os.close(parent_fd)
    return [RunRecord(parent / name) for name in sorted(names, key=_made_at)]


def _made_at(name: str) -> list[str]:
    """What a run's id sorts by: its date, its time, and its microseconds."""
    return name.rsplit("-", 3)[1:]


def _make_directory(parent_fd: int, name: str) -> tuple[str, str]:
    """A new record's directory, under the name it has while it is made; and the run's id."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "run"
    while True:
        now = datetime.datetime.now()
        run_id = f"{safe}-{now:%Y%m%d-%H%M%S}-{now.microsecond:05x}{secrets.randbelow(16):x}"
        making = f".making-{run_id}"
        try:
            # mkdir fails where the name exists: no two records are made under one id at once, and
            # the rename into place fails where a record of that id exists (it is not empty).
            os.mkdir(making, 0o700, dir_fd=parent_fd)
            return making, run_id
        except FileExistsError:
            continue


def _hold_runner(dir_fd: int, seen: bool) -> int:
    """Writes runner.json, naming this process, locked before anyone can see it: in a record being
    made, which nobody sees yet; else (`seen`) under a name of its own, then renamed into place.
    No reader finds this process's runner.json unlocked while it runs the call. Returns the lock's
    descriptor."""
    pending = f".{RUNNER}.{os.getpid()}.{secrets.token_hex(3)}" if seen else RUNNER
    fd = open_private(dir_fd, pending, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can have this new file open: never waits
        os.write(fd, json.dumps(runner_identity()).encode())
        if seen:
            os.rename(pending, RUNNER, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return fd
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pending, dir_fd=dir_fd)
        raise


def _write_new(dir_fd: int, name: str, data: bytes, sync: bool) -> None:
    """A file of a record being made, which nobody sees yet: written in place."""
    fd = open_private(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


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
    records = sorted((name for name in names if _RUN_ID.fullmatch(name)), key=_made_at)
    for name in records[: max(0, len(records) - keep)]:
        _remove_if_ended(parent, parent_fd, name)
    for name in names:
        if _MAKING.fullmatch(name):
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
                    return  # its runner runs it
            try:
                status = RunRecord(parent / name).state()["status"]
            except (FanrunError, OSError):
                return  # damaged: not fanrun's to remove
            if status in FINAL:
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


def _not_a_directory(path: Path, error: OSError) -> str:
    """What is at `path` instead of a record's directory, as the error of opening it tells."""
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            return "a symbolic link, which fanrun never follows" if os.path.islink(path) else "a file"
        except OSError:
            pass
    return f"unreadable ({os.strerror(error.errno or 0)})"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 1e11


def _check_state(value: dict) -> str | None:
    if value.get("status") not in STATUSES:
        return f"its status is none of {', '.join(STATUSES)}"
    if value.get("kind", DETACHED) not in (BLOCKING, DETACHED):
        return f"its kind is neither {BLOCKING} nor {DETACHED}"
    for field in ("created", "started", "ended", "updated"):
        if field in value and not _is_number(value[field]):
            return f"its {field} is not a time"
    for field in ("name", "reason", "run_dir"):
        if value.get(field) is not None and not isinstance(value[field], str):
            return f"its {field} is not text"
    size = value.get("world_size")
    if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
        return "its world_size is not a count of ranks"
    job = value.get("ray_job")
    if job is not None and not (isinstance(job, dict) and isinstance(job.get("address"), str)):
        return "its ray_job names no address"
    return None


def _check_attempt(value: dict) -> str | None:
    if not isinstance(value.get("run_dir"), str):
        return "it names no run directory"
    if not _is_number(value.get("started")):
        return "its started is not a time"
    return None


def _check_end(value: dict) -> str | None:
    if value.get("status") not in FINAL:
        return f"its status is none of {', '.join(FINAL)}"
    if not _is_number(value.get("ended")):
        return "its ended is not a time"
    if not isinstance(value.get("reason"), str):
        return "its reason is not text"
    return None


def _check_runner(value: dict) -> str | None:
    pid, start = value.get("pid"), value.get("start")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31):
        return "its pid is not a process id"
    if start is not None and not (isinstance(start, int) and not isinstance(start, bool)):
        return "its start is not a start time"
    return None


_own_start: tuple[int, int | None] | None = None


def runner_identity() -> dict:
    """This process: its pid and start time (read once per process; a forked child reads its own)."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:
        _own_start = (pid, process_start(pid))
    return {"pid": pid, "start": _own_start[1]}


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot); None if there is none, or it has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # ended, not yet reaped
        return None
    return int(fields[19])


class _ProcessEnd:
    """A pidfd of the runner being waited for, readable once it has ended."""

    def __init__(self) -> None:
        self._pid = None
        self.fds: tuple[int, ...] = ()

    def follow(self, pid: int, start: int | None) -> bool:
        """Whether the process `pid` that started at `start` is still there to be waited for."""
        if pid == self._pid:
            return True
        self.close()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        if process_start(pid) != start:  # ended, or another process has its pid now
            os.close(fd)
            return False
        self._pid, self.fds = pid, (fd,)
        return True

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self._pid, self.fds = None, ()

    def __enter__(self) -> _ProcessEnd:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

