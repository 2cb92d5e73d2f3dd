"""Node hardware: the hardware panel (htmx-refreshable), "probe now", and host-key approval."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from jobs import audit
from jobs.models import Job, JobKind
from ramdeck_site.roles import ADMIN, OPERATOR, VIEWER, role_required

from .models import Node, Reachability
from .probe_job import start_probe


def _get_node(name: str) -> Node:
    return get_object_or_404(Node, name=name)


def hardware_context(node: Node) -> dict:
    """What templates/nodes/_hardware.html needs besides `node`."""
    return {
        "node": node,
        "devices": node.devices.all(),
        "active_probe": Job.objects.active().filter(node=node, kind=JobKind.PROBE).first(),
    }


@role_required(VIEWER)
@require_GET
def hardware(request, name: str):
    """The hardware panel alone (htmx polls it while a probe runs); a full load gets the node page."""
    node = _get_node(name)
    if not request.htmx:
        return redirect(node)
    return render(request, "nodes/_hardware.html", hardware_context(node))


@role_required(OPERATOR)
@require_POST
def probe_now(request, name: str):
    node = _get_node(name)
    if not node.enabled:
        messages.error(request, f"{node.name} is disabled; enable it before probing.")
        return redirect(node)
    if node.pending_host_key:
        messages.error(
            request, f"{node.name}'s host key awaits an admin's approval; nothing runs there until then."
        )
        return redirect(node)
    job = start_probe(node, user=request.user)
    if job is None:
        messages.info(request, f"A probe of {node.name} is already queued or running.")
        return redirect(node)
    audit.record(request, "node.probe", node, changes={"job": job.pk})
    messages.success(request, f"Probing {node.name}.")
    return redirect(job)


@role_required(ADMIN)
@require_POST
def approve_host_key(request, name: str):
    """Pin the pending host key. The form carries the fingerprint the admin saw, so a key that changed
    again after the page was rendered is never approved unseen."""
    node = _get_node(name)
    seen = request.POST.get("fingerprint", "").strip()
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        if not locked.pending_host_key:
            messages.info(request, f"{locked.name} has no host key waiting for approval.")
            return redirect(locked)
        if seen != locked.pending_host_key_fingerprint:
            messages.error(
                request,
                f"The key waiting for approval is {locked.pending_host_key_fingerprint}, not the one you saw "
                f"({seen or 'none'}). Check it again before approving.",
            )
            return redirect(locked)
        old = locked.host_key_fingerprint
        locked.host_key = locked.pending_host_key
        locked.host_key_fingerprint = locked.pending_host_key_fingerprint
        locked.pending_host_key = ""
        locked.pending_host_key_fingerprint = ""
        locked.host_key_approved_at = timezone.now()
        locked.host_key_approved_by = request.user
        locked.reachability = Reachability.UNKNOWN
        locked.last_error = ""
        locked.save(
            update_fields=[
                "host_key",
                "host_key_fingerprint",
                "pending_host_key",
                "pending_host_key_fingerprint",
                "host_key_approved_at",
                "host_key_approved_by",
                "reachability",
                "last_error",
            ]
        )
        audit.record(
            request,
            "node.host_key.approve",
            locked,
            changes={"host_key_fingerprint": [old, locked.host_key_fingerprint], "replaced": bool(old)},
        )
    messages.success(request, f"Host key {locked.host_key_fingerprint} approved for {locked.name}.")
    if locked.enabled:
        start_probe(locked, user=request.user)
    return redirect(locked)
