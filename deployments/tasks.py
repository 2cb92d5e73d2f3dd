"""Celery tasks of deployments: thin wrappers that take a primary key and call deployments/lifecycle.py.

A redelivered `deploy` finds the deployment past `preparing` (or its steps no longer queued) and does
nothing; `stop` likewise acts only on a deployment in `stopping`.
"""

from __future__ import annotations

from celery import shared_task

from deployments import lifecycle, monitor


@shared_task(name="deployments.tasks.deploy", acks_late=True, ignore_result=True)
def deploy(deployment_id: int) -> None:
    lifecycle.run_deployment(deployment_id)


@shared_task(name="deployments.tasks.stop", acks_late=True, ignore_result=True)
def stop(deployment_id: int) -> None:
    lifecycle.run_stop(deployment_id)


@shared_task(name="deployments.tasks.restart", acks_late=True, ignore_result=True)
def restart(deployment_id: int) -> None:
    lifecycle.run_restart(deployment_id)


@shared_task(name="deployments.tasks.check_deployments", ignore_result=True)
def check_deployments() -> list[int]:
    """Beat: mark running deployments whose rpc-server or llama-server died as degraded."""
    return monitor.check_all()


@shared_task(name="deployments.tasks.scan_stale", ignore_result=True)
def scan_stale() -> int:
    """Beat: find rpc-servers and llama-servers of ours that belong to no active deployment."""
    return monitor.scan_stale()
