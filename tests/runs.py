"""A deployment's queued run, run here and now to its end in this process, as a worker would run it
(tests and benchmarks)."""

from __future__ import annotations

from deployments.lifecycle.actions import DEPLOY, UNDEPLOY
from jobs.models import Job, JobState
from jobs.runner import run_job


def run_latest(deployment_pk: int, kind: str) -> Job | None:
    """Run the newest queued run of `kind` of the deployment in this process, to its end."""
    run = Job.objects.filter(kind=kind, params__deployment=deployment_pk, state=JobState.QUEUED).order_by(
        "-pk"
    )
    job = run.first()
    if job is None:
        return None
    run_job(job.pk)
    job.refresh_from_db()
    return job


def run_deployment(pk: int) -> Job | None:
    return run_latest(pk, DEPLOY)


def run_stop(pk: int) -> Job | None:
    return run_latest(pk, UNDEPLOY)
