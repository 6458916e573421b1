"""fanrun.Run, fanrun.attach and fanrun.runs: the handle of any run, blocking or detached,
from the process that started it or from any other process of the same user. A run is found by
its record (_launch/records.py). A detached run's output and outcome are kept in its record; a
blocking call's output went to its caller and is read back from its ranks' logs
(_launch/rank_logs.py), and its results went to its caller alone."""

from __future__ import annotations

import datetime
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .._errors import FanrunError, RemoteTraceback, RunCancelledError, UnknownRunError
from .._launch import goodput, rank_logs, record_watch, records
from .._launch.record_files import FINAL, OUTCOME, DamagedRunError
from .._launch.records import RunRecord
from .._private_dir import open_private
from .._display.terminal_text import printable
from .._spec.spec import CallSpec
from . import files, keys, ray_job, stream

# How long start() waits for the runner to be up (its imports: fanrun, cloudpickle).
RUNNER_START_S = 60.0
# How long cancel() waits for the runner to stop the ranks (their grace period) and record it.
CANCEL_WAIT_S = 30.0


class Run:
    """A run, blocking or detached: its status, logs and (a detached run's) outcome; `.cancel()`
    stops a detached one."""

    def __init__(self, run_id: str) -> None:
        self._record = RunRecord.find(run_id)
        self.id = run_id
        state = self._record.state()
        self._blocking = state.get("kind") == records.BLOCKING
        job = state.get("ray_job")
        self._job = ray_job.RayJob(self._record, job["address"]) if job is not None else None

    @classmethod
    def _listed(cls, record: RunRecord) -> Run:
        """A run of a listing. A damaged one is listed too: reading its status raises
        DamagedRunError, which says what is wrong with it."""
        try:
            return cls(record.id)
        except DamagedRunError:
            run = cls.__new__(cls)
            run._record, run.id, run._job, run._blocking = record, record.id, None, False
            return run

    @property
    def status(self) -> str:
        """QUEUED, RUNNING, FINISHED, FAILED or KILLED."""
        if self._job is not None:
            return self._job.status()
        return self._record.state()["status"]

    @property
    def info(self) -> dict:
        """The whole recorded state: status, kind, times, the reason it failed, its rank logs' directory."""
        return self._record.state()

    @property
    def goodput(self) -> goodput.Goodput | None:
        """Where the run's wall time went, over all its attempts (docs/goodput.md): the ledger kept
        in its record as it ended; None while it runs."""
        return goodput.read(self._record)

    def logs(self, rank: int | None = None, follow: bool = False) -> str | None:
        """The call's output so far, as a blocking call shows it (rank=N: that rank's full log).
        With follow=True, it is written here as it comes, until the run ends; returns None."""
        if self._job is not None:
            return self._job.follow(rank) if follow else self._job.logs(rank)
        if self._blocking:
            if follow:
                rank_logs.follow(self._record, rank=rank)
                return None
            return rank_logs.read(self._record, rank=rank)
        if follow:
            stream.follow(self._record.directory, rank=rank)
            return None
        if rank is None:
            data = self._record.read_bytes(files.OUTPUT) or b""
        else:
            data = self._rank_log(rank)
        return data.decode("utf-8", "replace")

    def wait(self, timeout: float | None = None) -> str:
        """Blocks until the run has ended, or `timeout` seconds have passed; returns its status."""
        if self._job is not None:
            return self._job.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        status = record_watch.wait(self._record, timeout)
        runner = None if self._blocking or status not in FINAL else self._record.read_runner()
        if runner is not None:
            # Its runner ends soon after the run, once its readers have had the output's end.
            _wait_for_process(runner["pid"], runner["start"], None if deadline is None else deadline - time.monotonic())
        return status

    def result(self, timeout: float | None = None) -> list:
        """The ranks' values, in rank order, once the run has ended; or the exception a blocking
        call would have raised (RunCancelledError for a cancelled run). A blocking call's went
        to its caller: FanrunError, which says so."""
        if self._blocking:
            raise FanrunError(f"run {self.id} is a blocking call, whose results went to its caller "
                              f"(pid {self._caller_pid()}) as the call returned them; fanrun keeps none. "
                              f"Run.result() gives a detached run's: @distributed(detach=True), or `fanrun submit`")
        status = self.wait(timeout)
        if status not in FINAL:
            waited = "its runner is still starting" if timeout is None else f"after {timeout:g} s"
            raise TimeoutError(f"run {self.id} is still {status}: {waited}")
        data = self._job.outcome() if self._job is not None else self._record.read_bytes(OUTCOME)
        if data is None:
            raise FanrunError(f"run {self.id} ended {status} without an outcome: {self._reason()}")
        outcome = pickle.loads(data)
        if "results" in outcome:
            return outcome["results"]
        if outcome.get("cancelled"):
            raise RunCancelledError(f"run {self.id} was cancelled")
        error = pickle.loads(outcome["exception"]) if outcome["exception"] is not None else None
        if error is None:
            raise FanrunError(f"run {self.id} failed with an exception that could not be carried over "
                              f"({outcome['type']}):\n{outcome['text']}")
        if outcome["cause"] is not None:
            raise error from RemoteTraceback(outcome["cause"])
        raise error

    def cancel(self) -> str:
        """Stops the run's ranks, as Ctrl+C stops a blocking call's; returns once it has ended. A
        blocking call is stopped where it runs: FanrunError, which says how."""
        if self._job is not None:
            if self.status not in FINAL:
                self._job.cancel()
            return self.wait(CANCEL_WAIT_S)
        if self._blocking:
            status = self.status
            if status in FINAL:
                return status
            pid = self._caller_pid()
            raise FanrunError(f"run {self.id} is a blocking call, run by its caller (pid {pid}), which waits for its "
                              f"results: stop it there, with Ctrl+C (in a notebook, interrupt the kernel), or from "
                              f"a shell with `kill -INT {pid}`, which stops its ranks as Ctrl+C does")
        runner = self._record.read_runner()
        if runner is not None and self._record.state()["status"] not in FINAL:
            # Only the runner recorded for this run, not a later process with its pid.
            if records.process_start(runner["pid"]) == runner["start"]:
                try:
                    os.kill(runner["pid"], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        return self.wait(CANCEL_WAIT_S)

    def _caller_pid(self) -> int | str:
        runner = self._record.read_runner()  # a blocking call's record names its caller from the start
        return "unknown" if runner is None else runner["pid"]

    def _reason(self) -> str | None:
        if self._job is not None and not self.info.get("reason"):
            tail = self._job.logs().strip().splitlines()[-5:]
            return "its Ray job's output ends with:\n" + "\n".join(tail) if tail else "its Ray job printed nothing"
        return self.info.get("reason")

    def _rank_log(self, rank: int) -> bytes:
        # Only a run directory of the runs root, never a link: the state could name any place.
        found = self._record.run_directory()
        if found is None:
            return b""
        _, dir_fd = found
        try:
            fd = open_private(dir_fd, f"rank_{int(rank)}.log", os.O_RDONLY)
        except FileNotFoundError:
            return b""
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as log:
            return log.read()

    def __repr__(self) -> str:
        return f"<fanrun.Run {self.id} {_status(self)[0]}>"  # DAMAGED or UNKNOWN rather than an error


def submit(spec: CallSpec, *, cwd: str, idempotency_key: str | None = None) -> Run:
    """Starts a workload's run in `cwd`; with an idempotency key that a run has already claimed,
    returns that run instead and starts nothing."""
    record = _created(spec.name, spec.plan.world_size)
    claimed = _claimed_by(idempotency_key, record)
    if claimed is not None:
        return claimed
    return start(spec, cwd=cwd, record=record)


def submit_to_ray(workload, *, cwd: str, ray_address: str, idempotency_key: str | None = None) -> Run:
    """Submits a workload of more than one node as a job to the Ray cluster at `ray_address` (its
    dashboard's), as submit() does for this machine."""
    record = _created(workload.name, None, ray_job={"address": ray_address})
    claimed = _claimed_by(idempotency_key, record)
    if claimed is not None:
        return claimed
    ray_job.submit(record, workload, address=ray_address, cwd=cwd)
    return Run(record.id)


def _created(name: str, world_size: int | None, **fields: object) -> RunRecord:
    return RunRecord.create(name, kind=records.DETACHED, world_size=world_size, owner=False, **fields)


def _claimed_by(idempotency_key: str | None, record: RunRecord) -> Run | None:
    """The run that claimed this idempotency key before, with `record`, this one's, removed; None
    where this run is the first to claim it (or there is no key)."""
    if idempotency_key is None:
        return None
    claimed = keys.claim(idempotency_key, record.id)
    if claimed == record.id:
        return None
    record.remove_unstarted()
    return Run(claimed)


def start(spec: CallSpec, *, cwd: str | None = None, record: RunRecord | None = None) -> Run:
    """Starts a runner for the call, in `cwd` (default: this one); returns once the runner is up,
    with the run's handle. `record`: the run's, made already."""
    record = record or _created(spec.name, spec.plan.world_size)
    runner_spec = {"call": spec, "sys_path": list(sys.path), "cwd": cwd or os.getcwd()}
    record.write_bytes(files.SPEC, pickle.dumps(runner_spec, protocol=pickle.HIGHEST_PROTOCOL))
    # This fanrun, whatever the caller's sys.path; the runner takes the caller's once it runs.
    bootstrap = f"import sys; sys.path.insert(0, {_package_parent()!r}); from fanrun._detached.runner import main; main()"
    runner = subprocess.Popen(
        [sys.executable, "-c", bootstrap, record.id],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,  # neither the caller's Ctrl+C nor its end reaches the run
    )
    ready = _read_ready(runner)
    if ready != b"ready\n":
        runner.kill()
        error = runner.communicate()[1].decode(errors="replace")
        record.end(records.FAILED, "its runner did not start")
        raise RuntimeError(f"fanrun: the run's runner did not start:\n{error}")
    runner.stdout.close()
    runner.stderr.close()
    # Reaped when it ends, so that it leaves no zombie behind in a caller that lives on.
    threading.Thread(target=runner.wait, name="fanrun-runner-reaper", daemon=True).start()
    return Run(record.id)


def attach(run_id: str) -> Run:
    """Writes the run's output here, from its start, as it comes, until it ends; returns its Run."""
    run = Run(run_id)
    run.logs(follow=True)
    return run


def runs(all: bool = False) -> list[Run]:  # noqa: A002 - the CLI's --all
    """This user's runs, blocking and detached, oldest first: those not ended yet, or every one
    kept (records.KEEP_RECORDS) with all=True."""
    found = []
    for record in records.all_records():
        try:
            found.append(Run._listed(record))
        except UnknownRunError:
            continue  # removed since it was listed
    return found if all else [run for run in found if _status(run)[0] not in FINAL]


COLUMNS = ("RUN", "STATUS", "STARTED", "TOOK", "WHY")


def table(found: list[Run]) -> list[str]:
    """The lines of `fanrun list`: a header, then one line per run, in aligned columns. No text
    of a run reaches the terminal with a control character in it (_display/terminal_text.py)."""
    rows = [COLUMNS] + [tuple(printable(cell, keep="") for cell in _row(run)) for run in found]
    widths = [max(len(row[column]) for row in rows) for column in range(len(COLUMNS) - 1)]
    lines = []
    for row in rows:
        cells = [cell.rjust(width) if column == 3 else cell.ljust(width)
                 for column, (cell, width) in enumerate(zip(row, widths))]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def _row(run: Run) -> tuple[str, str, str, str, str]:
    status, problem = _status(run)
    try:
        info = run.info  # what is on disk: a Ray job's too, when its cluster does not answer
    except FanrunError as error:
        status, problem, info = _damaged_or_unknown(error), problem or str(error), {}
    created, ended = info.get("created"), info.get("ended")
    started = "-" if created is None else datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
    took = "-" if created is None else f"{(ended or time.time()) - created:.0f} s"
    reason = problem or info.get("reason") or ""
    return run.id, status, started, took, reason.split("\n", 1)[0]


def _status(run: Run) -> tuple[str, str | None]:
    """The run's status, or DAMAGED or UNKNOWN (a Ray job's cluster that does not answer) and why."""
    try:
        return run.status, None
    except FanrunError as error:
        return _damaged_or_unknown(error), str(error)


def _damaged_or_unknown(error: FanrunError) -> str:
    return "DAMAGED" if isinstance(error, DamagedRunError) else "UNKNOWN"


def _package_parent() -> str:
    """Where the runner finds this fanrun, whatever the caller's sys.path."""
    return str(Path(__file__).resolve().parents[2])


def _read_ready(runner: subprocess.Popen) -> bytes:
    """The runner's first line, or b"" if it ended or took longer than RUNNER_START_S."""
    poller = select.poll()
    poller.register(runner.stdout, select.POLLIN)
    if not poller.poll(RUNNER_START_S * 1000):
        return b""
    return runner.stdout.readline()


def _wait_for_process(pid: int, start: int | None, timeout: float | None) -> None:
    """Until process `pid` (the one that started at `start`) has ended, or `timeout` has passed."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if records.process_start(pid) != start:
            return  # another process has its pid now: the runner has ended
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
    finally:
        os.close(pidfd)
