"""Self-healing, for deployments that opt in: when the monitor (deployments/monitor.py) finds one degraded
(a worker's rpc-server died, a laptop woke up and lost its processes), a `heal` run stops what is left of
it, then reaps, starts and verifies everything again, as a deploy would, keeping its claims. Attempts back
off (RAMDECK_SELF_HEAL_BACKOFF_S, doubling) and are limited (RAMDECK_SELF_HEAL_ATTEMPTS): the last one that
fails fails the deployment. Every attempt is a job with its log, and in the audit history.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.history import record
from deployments.lifecycle.actions import (
    HEAL,
    UNDEPLOY,
    active_run,
    create_launch_steps,
    new_run,
    runs_of,
    stop_steps,
)
from deployments.lifecycle.runs import audit_run, run_steps, teardown
from deployments.models import Deployment, DeploymentState
from deployments.steps.common import load_deployment
from jobs.aio import db
from jobs.context import JobContext
from jobs.models import ACTIVE_STATES as ACTIVE_JOB_STATES
from jobs.models import Job


def next_attempt_at(deployment: Deployment):
    """When the next attempt may start: at once for the first, then after a doubling backoff."""
    if not deployment.heal_attempts or deployment.last_heal_at is None:
        return None
    wait = settings.RAMDECK_SELF_HEAL_BACKOFF_S * 2 ** (deployment.heal_attempts - 1)
    return deployment.last_heal_at + timedelta(seconds=wait)


def consider(deployment: Deployment) -> Job | None:
    """The monitor found this deployment degraded: start an attempt if it opted in, the backoff has passed
    and attempts are left. Returns the heal run, or None."""
    if not deployment.self_heal or deployment.state != DeploymentState.DEGRADED:
        return None
    if deployment.heal_attempts >= settings.RAMDECK_SELF_HEAL_ATTEMPTS:
        return None
    due = next_attempt_at(deployment)
    if due is not None and timezone.now() < due:
        return None
    return start_heal(deployment)


def start_heal(deployment: Deployment) -> Job | None:
    with transaction.atomic():
        busy = runs_of(deployment).filter(state__in=ACTIVE_JOB_STATES).exists()
        if busy or active_run(deployment, UNDEPLOY) is not None or not deployment.mark_healing():
            return None
        reason = deployment.state_reason
        run = new_run(deployment, HEAL, f"Self-heal {deployment} (attempt {deployment.heal_attempts})")
        stops = stop_steps(deployment, run, "stop")
        last = deployment.steps.order_by("-order").values_list("order", flat=True).first() or 0
        create_launch_steps(deployment, run, after=last)
        record(
            None,
            "deployment.heal_started",
            deployment,
            changes={
                "attempt": deployment.heal_attempts,
                "run": run.pk,
                "stops": len(stops),
                "reason": reason[:1000],
            },
            actor_name="self-heal",
        )
        run.enqueue()
    return run


async def heal_failed(ctx, deployment: Deployment, step: str, reason: str) -> None:
    """A step of the attempt failed: end what it started; degraded again, or failed after the last try."""
    failures = await teardown(ctx, deployment, "rollback")
    await db(_settle_failed_attempt)(deployment, step, reason, failures)


def _settle_failed_attempt(deployment: Deployment, step: str, reason: str, failures: list[str]) -> None:
    deployment.refresh_from_db()
    attempt, limit = deployment.heal_attempts, settings.RAMDECK_SELF_HEAL_ATTEMPTS
    note = f"Self-healing attempt {attempt} of {limit} failed at {step}: {reason}"
    if failures:
        note += "\n\nRollback incomplete: " + "; ".join(failures)
    changes = {"attempt": attempt, "step": step, "reason": reason[:1000], "rollback_failures": failures}
    if attempt >= limit:
        if deployment.fail(step, f"{note}\n\nSelf-healing gave up after {limit} attempts."):
            record(None, "deployment.failed", deployment, changes=changes, actor_name="self-heal")
        return
    if deployment.mark_heal_failed(note):
        due = next_attempt_at(deployment)
        changes["next_attempt_at"] = due.isoformat() if due else None
        record(None, "deployment.heal_failed", deployment, changes=changes, actor_name="self-heal")


async def heal_body(ctx: JobContext) -> str:
    """A self-healing attempt: the heal run's steps stop what is left, then start and verify everything
    again. Not back to running: rolled back, degraded again (or failed, when it was the last attempt
    allowed)."""
    deployment = await load_deployment(ctx)
    await run_steps(ctx, deployment, on_failure=heal_failed)
    await db(audit_run)(
        deployment, "deployment.healed", {"attempt": deployment.heal_attempts, "run": ctx.job.pk}
    )
    return f"{deployment} is running again."
