"""Celery tasks of deployments: the periodic checks (beat, on the control queue). A deployment's runs are
jobs (deployments/lifecycle/actions.py) and go through jobs.tasks.run_job like every job."""

from __future__ import annotations

from celery import shared_task

from deployments import monitor


@shared_task(name="deployments.tasks.check_deployments", ignore_result=True)
def check_deployments() -> list[int]:
    """Beat: mark running deployments whose rpc-server or llama-server died as degraded."""
    return monitor.check_all()


@shared_task(name="deployments.tasks.scan_stale", ignore_result=True)
def scan_stale() -> int:
    """Beat: find rpc-servers and llama-servers of ours that belong to no active deployment."""
    return monitor.scan_stale()
