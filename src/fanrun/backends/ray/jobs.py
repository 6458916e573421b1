"""The client of a Ray cluster's job server (Ray Jobs), for workloads that run there as jobs
(_detached/ray_job.py): the one place outside a call that imports ray."""

from __future__ import annotations

from ..._errors import FanrunError


def job_client(address: str):
    """A JobSubmissionClient of the job server at `address` (`http://head:8265`)."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise FanrunError("a workload with compute.nodes above 1 runs as a Ray job: pip install 'ray[default]'") from None
    return JobSubmissionClient(address)
