"""What every step body of a deployment uses: its deployment, loaded with its nodes, and its audit entries."""

from __future__ import annotations

from audit.history import record
from deployments.models import Deployment
from jobs.aio import db


def deployment_with_nodes(pk: int):
    return Deployment.objects.select_related("coordinator", "model_file").get(pk=pk)


async def load_deployment(ctx):
    return await db(deployment_with_nodes)(ctx.job.params["deployment"])


def audit_step(job, action: str, obj, changes: dict) -> None:
    record(job.created_by, action, obj, changes=changes, actor_name="" if job.created_by_id else "console")
