"""Celery tasks of the nodes app: thin, primary keys only."""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from nodes.models import Node
from nodes.probe.job import periodic_probe

logger = logging.getLogger(__name__)


@shared_task(name="nodes.tasks.probe_all_nodes", ignore_result=True)
def probe_all_nodes() -> list[int]:
    """Beat: one probe job per enabled node, unless one is already active, a host key awaits an admin
    (probing again would only repeat "not approved" until someone looks at the node page), or the node is
    offline and its backoff has not passed or it still does not answer (nodes/probe/job.py)."""

    created = []
    now = timezone.now()
    for node in Node.objects.filter(enabled=True, pending_host_key="").select_related("credential"):
        job = periodic_probe(node, now)
        if job is not None:
            created.append(job.pk)
    logger.info("Queued %d probe job(s).", len(created))
    return created
