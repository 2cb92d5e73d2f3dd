"""Celery tasks of deployments: thin wrappers that take a primary key and call deployments/lifecycle.py.

A redelivered `deploy` finds the deployment past `preparing` (or its steps no longer queued) and does
nothing; `stop` likewise acts only on a deployment in `stopping`.
"""

from __future__ import annotations

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from deployments import lifecycle, monitor


@shared_task(name="deployments.tasks.deploy", bind=True, acks_late=True, ignore_result=True)
def deploy(self, deployment_id: int) -> None:
    # The steps run inline under this worker's name, so the sweeper can tell whether it still lives.
    worker = self.request.hostname or ""
    try:
        lifecycle.run_deployment(deployment_id, worker)
    except SoftTimeLimitExceeded:
        lifecycle.abort_deployment(
            deployment_id, "The deployment ran past the time limit for tasks and was rolled back.", worker
        )


@shared_task(name="deployments.tasks.stop", bind=True, acks_late=True, ignore_result=True)
def stop(self, deployment_id: int) -> None:
    lifecycle.run_stop(deployment_id, self.request.hostname or "")


@shared_task(name="deployments.tasks.restart", bind=True, acks_late=True, ignore_result=True)
def restart(self, deployment_id: int) -> None:
    lifecycle.run_restart(deployment_id, self.request.hostname or "")


@shared_task(name="deployments.tasks.check_deployments", ignore_result=True)
def check_deployments() -> list[int]:
    """Beat: mark running deployments whose rpc-server or llama-server died as degraded."""
    return monitor.check_all()


@shared_task(name="deployments.tasks.scan_stale", ignore_result=True)
def scan_stale() -> int:
    """Beat: find rpc-servers and llama-servers of ours that belong to no active deployment."""
    return monitor.scan_stale()
