"""Celery tasks for jobs: thin wrappers that take primary keys and call the runner or the sweeper.

Late acknowledgement (settings) means a task whose worker died is delivered again; the runner's
conditional `queued → running` claim makes that second delivery a no-op, and the sweeper turns the
orphaned running job into `errored` ("worker lost") — at once when the redelivery lands on the same host
and finds the process that ran it gone.
"""

from __future__ import annotations

import logging

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_init, worker_ready
from django.db import InterfaceError, OperationalError
from django.utils import timezone

from jobs import runner, sweeper
from jobs.models import Job, JobState

logger = logging.getLogger(__name__)


@shared_task(
    bind=True,
    name="jobs.tasks.run_job",
    acks_late=True,
    # Only failures before the job is claimed are worth a retry (the database was briefly away); once
    # claimed, a retry finds the job running and does nothing, and the sweeper takes over.
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=5,
    retry_backoff_max=120,
    retry_jitter=True,
    max_retries=5,
)
def run_job(self, job_id: int) -> None:
    hostname = self.request.hostname or ""
    try:
        if not runner.run_job(job_id, worker=hostname):
            sweeper.sweep_dead_runner(job_id, hostname)
    except SoftTimeLimitExceeded:
        # A backstop: the runner stops a job at its own time limit (RAMDECK_JOB_SOFT_TIME_LIMIT) first.
        job = Job.objects.select_related("node").get(pk=job_id)
        if job.state == JobState.RUNNING:
            sweeper.abandon(job, "The job ran past the time limit for jobs and was stopped.")


@shared_task(name="jobs.tasks.sweep_lost_jobs", ignore_result=True)
def sweep_lost_jobs() -> list[int]:
    lost = sweeper.sweep()
    sweeper.sweep_queued()
    return lost


# -- a worker that starts again cleans up after its previous life ---------------------------------------

_started_at = None


@worker_init.connect
def _remember_start(**kwargs) -> None:
    global _started_at
    _started_at = timezone.now()


@worker_ready.connect
def _sweep_previous_life(sender=None, **kwargs) -> None:
    hostname = getattr(sender, "hostname", None)
    if not hostname:
        return
    try:
        lost = sweeper.sweep_own_jobs(hostname, _started_at or timezone.now())
    except Exception:
        logger.exception("Sweeping the jobs of %s's previous run failed.", hostname)
        return
    if lost:
        logger.warning("%s restarted: jobs %s were running under it and are now errored.", hostname, lost)
