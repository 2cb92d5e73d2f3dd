"""Celery tasks of the nodes app: thin, primary keys only."""

from __future__ import annotations

import logging

from celery import shared_task

from nodes.models import Node
from nodes.probe.job import start_probe

logger = logging.getLogger(__name__)


@shared_task(name="nodes.tasks.probe_all_nodes", ignore_result=True)
def probe_all_nodes() -> list[int]:
    """Beat: one probe job per enabled node, unless one is already active or a host key awaits an admin
    (probing again would only repeat "not approved" until someone looks at the node page)."""

    created = []
    for node in Node.objects.filter(enabled=True, pending_host_key=""):
        job = start_probe(node)
        if job is not None:
            created.append(job.pk)
    logger.info("Queued %d probe job(s).", len(created))
    return created
