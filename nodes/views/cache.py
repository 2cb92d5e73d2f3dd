"""A node's RPC cache on its page: read it again, clear it (operators; asked to confirm; refused while a
deployment uses the node). Both are `rpc_cache` jobs (nodes/cache.py) with an audit entry."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from audit import history
from jobs.models import Job, refuse_local_node
from nodes import cache
from nodes.views.nodes import get_node
from ramdeck_site.roles import OPERATOR, role_required


def _start(request, node, action: str, audit_action: str, doing: str):
    refuse_local_node(request.user, node, "RPC cache jobs", request=request)
    with transaction.atomic():
        if Job.objects.active().filter(node=node, kind=cache.KIND).exists():
            messages.info(request, f"An RPC cache job on {node.name} is already queued or running.")
            return redirect(node)
        job = cache.start(node, action, request.user)
        history.record(request, audit_action, node, changes={"job": job.pk})
    messages.success(request, f"{doing} {node.name}'s RPC cache.")
    return redirect(job)


@role_required(OPERATOR)
@require_POST
def rpc_cache_read(request, name: str):
    return _start(request, get_node(name), "usage", "node.rpc_cache.read", "Reading")


@role_required(OPERATOR)
def rpc_cache_clear(request, name: str):
    """GET asks for confirmation; POST clears, unless a deployment uses the node (said, and audited)."""
    node = get_node(name)
    why = cache.refusal(node)
    if request.method == "POST":
        if why:
            history.record(request, "node.rpc_cache.clear_refused", node, changes={"why": why})
            messages.error(request, why)
            return redirect(node)
        return _start(request, node, "clear", "node.rpc_cache.clear", "Clearing")
    return render(request, "nodes/rpc_cache_confirm_clear.html", {"node": node, "refusal": why})
