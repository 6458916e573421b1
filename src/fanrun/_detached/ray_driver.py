"""The entrypoint of a workload's Ray job (ray_job.py): `python -m fanrun._detached.ray_driver
<fields>`, run by the cluster's job server on its head, in the workload file's folder.

It is the call's caller: it runs the workload through fanrun's Ray backend as a blocking call
would, its output is the job's, and its last line is the outcome (ray_job.OUTCOME_MARK). The job
server's stop (a cancel) is SIGTERM, which stops the ranks as Ctrl+C stops a blocking call's.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import signal
import sys
import traceback
from pathlib import Path

from .._launch import call
from .._errors import raised_for_the_caller
from . import runner
from .ray_job import OUTCOME_MARK
from .workload import from_fields, spec_of


def main() -> int:
    import cloudpickle

    from ..backends.ray.connect import ray_init, ray_shutdown

    fields = json.loads(base64.urlsafe_b64decode(sys.argv[1]))
    signal.signal(signal.SIGTERM, runner.cancel)
    try:
        workload = from_fields(fields, Path.cwd())
        ray_init()  # the job's own cluster
        signal.signal(signal.SIGTERM, runner.cancel)  # again: Ray's worker set its own, which exits at once
        results = call.run(spec_of(dataclasses.replace(workload, options=dataclasses.replace(workload.options,
                                                                                               backend="ray"))))
        outcome, status = cloudpickle.dumps({"results": results}), 0
    except runner.Cancelled:
        print("fanrun: the run was cancelled; its ranks were stopped", file=sys.stderr)
        outcome, status = cloudpickle.dumps({"cancelled": True}), 130
    except BaseException as error:  # noqa: B036 - whatever a blocking call would raise, recorded
        traceback.print_exception(type(error), error, None if raised_for_the_caller(error) else error.__traceback__)
        outcome, status = runner.failure(error), 1
    finally:
        ray_shutdown()
    sys.stderr.flush()
    print(f"\n{OUTCOME_MARK}{base64.b64encode(outcome).decode()}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
