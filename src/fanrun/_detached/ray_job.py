"""A workload with `compute.nodes` above 1, run as a Ray job: the cluster's own job system keeps
it going, whatever happens to the machine that submitted it, and fanrun schedules nothing itself.

The job's entrypoint is ray_driver.py, run on the cluster's head in the workload file's folder
(uploaded as the job's working_dir); it runs the call through fanrun's Ray backend and prints the
outcome as its last line, marked with OUTCOME_MARK. Here, the run's record holds the
cluster's address and the job's id (the run's id); status, logs, waiting and cancelling ask the
cluster's job server, and a final status is recorded so that later reads need no cluster.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from .._errors import FanrunError
from .._launch import records
from .._launch.record_files import OUTCOME
from .._launch.records import RunRecord
from ..backends.ray.jobs import job_client

# The line of the job's output that carries the outcome (a pickled dict, as outcome.pkl holds).
OUTCOME_MARK = "fanrun-outcome: "
# Ray's job statuses as a run's.
STATUS = {"PENDING": records.QUEUED, "RUNNING": records.RUNNING, "SUCCEEDED": records.FINISHED,
          "FAILED": records.FAILED, "STOPPED": records.KILLED}


def submit(record: RunRecord, workload, *, address: str, cwd: str) -> None:
    """Submits the workload as the job of the run of `record` (made with its cluster's address,
    ray_job={"address": ...}), with the run's id as its id."""
    fields = json.dumps(workload.fields)  # the file's own values: YAML scalars, lists and mappings
    entrypoint = f"python -m fanrun._detached.ray_driver {base64.urlsafe_b64encode(fields.encode()).decode()}"
    try:
        job_client(address).submit_job(entrypoint=entrypoint, submission_id=record.id,
                                       runtime_env={"working_dir": cwd}, metadata={"fanrun_run": workload.name})
    except Exception as error:
        record.end(records.FAILED, f"the Ray cluster at {address} did not take the job: {error}")
        raise FanrunError(f"the Ray cluster at {address} did not take the job: {error}") from None


class RayJob:
    """The Ray job of one run, through the cluster's job server."""

    def __init__(self, record: RunRecord, address: str) -> None:
        self.record = record
        self.id = record.id
        self.address = address

    def status(self) -> str:
        recorded = self.record.state()
        if recorded["status"] in records.FINAL:
            return recorded["status"]
        answer = self._call("get_job_status")
        status = STATUS.get(str(getattr(answer, "value", answer)), records.RUNNING)
        if status in records.FINAL:
            self.record.end(status, recorded.get("reason") or "")
        return status

    def logs(self, rank: int | None = None) -> str:
        return _shown(self._call("get_job_logs"), rank)

    def follow(self, rank: int | None = None) -> None:
        """Writes the job's output here from its start as it comes, until it ends."""
        pending = ""  # a line that a chunk ended in the middle of

        async def tail() -> None:
            nonlocal pending
            async for chunk in self._client().tail_job_logs(self.id):
                whole, _, pending = (pending + chunk).rpartition("\n")
                if whole:
                    sys.stdout.write(_shown(whole + "\n", rank))
                    sys.stdout.flush()

        asyncio.run(tail())
        sys.stdout.write(_shown(pending, rank))
        sys.stdout.flush()

    def wait(self, timeout: float | None) -> str:
        """The job server streams a job's logs until it ends: waiting is reading them to their end."""
        if self.status() not in records.FINAL:
            async def drain() -> None:
                async for _ in self._client().tail_job_logs(self.id):
                    pass

            try:
                asyncio.run(asyncio.wait_for(drain(), timeout))
            except asyncio.TimeoutError:
                pass
        return self.status()

    def outcome(self) -> bytes | None:
        """outcome.pkl's bytes, from the driver's last line; recorded here once read. Run.result()
        unpickles them: the cluster is trusted with that as the Ray backend trusts it with every
        call's results, and as it is trusted to run the workload at all."""
        data = self.record.read_bytes(OUTCOME)
        if data is not None:
            return data
        for line in reversed(self._call("get_job_logs").splitlines()):
            if line.startswith(OUTCOME_MARK):
                data = base64.b64decode(line[len(OUTCOME_MARK):])
                self.record.write_bytes(OUTCOME, data)
                return data
        return None

    def cancel(self) -> None:
        self._call("stop_job")

    def _client(self):
        return job_client(self.address)

    def _call(self, method: str):
        try:
            return getattr(self._client(), method)(self.id)
        except Exception as error:
            raise FanrunError(f"run {self.id} is a job of the Ray cluster at {self.address}, which did not answer "
                              f"({type(error).__name__}: {error})") from None


def _shown(text: str, rank: int | None) -> str:
    """The job's output as a run's: without the outcome's line; with `rank`, that rank's lines alone."""
    lines = [line for line in text.splitlines(keepends=True) if not line.startswith(OUTCOME_MARK)]
    if rank is not None:
        prefix = f"[rank{rank}]: "
        lines = [line[len(prefix):] for line in lines if line.startswith(prefix)]
    return "".join(lines)
