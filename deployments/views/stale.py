"""Stale processes: the rpc-servers and llama-servers of ours that no deployment owns, and their reaping."""

from __future__ import annotations

from django.db import transaction
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from audit import history
from deployments.models import StaleProcess
from jobs.models import Job, refuse_local_node
from ramdeck_site.roles import OPERATOR, VIEWER, can_operate, role_required


@role_required(VIEWER)
def stale_processes(request):
    """A region for the dashboard (and a page of its own): our processes that no deployment owns."""
    rows = StaleProcess.objects.select_related("node")
    return render(
        request,
        "deployments/stale.html" + ("#region" if request.htmx else ""),
        {"rows": rows, "can_operate": can_operate(request.user)},
    )


@require_POST
@role_required(OPERATOR)
def stale_reap(request, pk: int):
    stale = get_object_or_404(StaleProcess.objects.select_related("node"), pk=pk)
    refuse_local_node(request.user, stale.node, "Reaps", request=request)
    with transaction.atomic():
        job = Job.objects.create(
            kind="reap",
            node=stale.node,
            title=f"Reap {stale.program} PID {stale.pid} on {stale.node.name}:{stale.port}",
            # The PID too: the reap ends that process only, never whatever holds the port by now.
            params={"ports": [stale.port], "pid": stale.pid},
            created_by=request.user,
        )
        history.record(
            request, "process.reap_requested", stale.node, changes={"pid": stale.pid, "port": stale.port}
        )
        job.enqueue()
    return redirect(job.get_absolute_url())
