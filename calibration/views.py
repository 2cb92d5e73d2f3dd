"""Calibration on the node pages: calibrate one node or every node, and an admin's own figures."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from audit import history
from calibration.forms import BandwidthOverrideForm
from calibration.store import refusal, serving, start_calibration
from jobs.models import may_use_local_node, refuse_local_node
from nodes.models import Node
from nodes.views.nodes import get_node, start_node_job
from ramdeck_site.roles import ADMIN, OPERATOR, role_required


@role_required(OPERATOR)
@require_POST
def calibrate_now(request, name: str):
    node = get_node(name)
    if not node.enabled or node.pending_host_key:
        messages.error(request, f"{node.name} is disabled or awaits host-key approval: nothing runs there.")
        return redirect(node)
    refuse_local_node(request.user, node, "Calibrations", request=request)  # a 403 before any other reason
    if reason := refusal(node):
        # Said here, with no job: one that fails at once would only sit among the dashboard's failed jobs.
        messages.error(request, reason)
        return redirect(node)
    return start_node_job(
        request, node, start_calibration, action="node.calibrate", what="calibration", doing="Calibrating"
    )


@role_required(OPERATOR)
@require_POST
def calibrate_all(request):
    """One calibration job per enabled node that has a build and devices; Celery runs them in parallel."""

    started, skipped, busy = [], [], []
    with transaction.atomic():
        for node in Node.objects.filter(enabled=True, pending_host_key="").prefetch_related("devices"):
            if node.current_build is None or not node.devices.all():
                continue
            if deployments := serving(node):
                busy.append(f"{node.name} (serves {', '.join(d.name for d in deployments)})")
                continue
            if not may_use_local_node(request.user, node):
                skipped.append(node.name)  # The console's own host: admins only (jobs/models.py).
                continue
            job = start_calibration(node, user=request.user)
            if job is not None:
                started.append(node.name)
        if started:
            history.record(request, "node.calibrate_all", changes={"nodes": started}, object_type="node")
    if started:
        messages.success(request, f"Calibrating {', '.join(started)} in parallel.")
    else:
        messages.info(request, "No node to calibrate: each needs a llama.cpp build and a probe first.")
    if busy:
        messages.warning(
            request,
            f"Not calibrated: {', '.join(busy)}. A running deployment's page offers to stop it, calibrate "
            "its nodes and start it again.",
        )
    if skipped:
        messages.warning(
            request,
            f"Not calibrated: {', '.join(skipped)}, the console's own host (the admin role calibrates it).",
        )
    return redirect("nodes:list")


@role_required(ADMIN)
def bandwidth_override(request, name: str):
    """An admin's own bandwidth figure per device, which wins over measurements and the table. Audited."""
    node = get_node(name)
    devices = list(node.devices.all())
    form = BandwidthOverrideForm(request.POST or None, devices=devices)
    if request.method == "POST" and form.is_valid():
        changes = form.changes()
        with transaction.atomic():
            for device, old, new in changes:
                device.bandwidth_override_gbs = new
                device.save(update_fields=["bandwidth_override_gbs", "updated_at"])
                change = {"bandwidth_override_gbs": [old, new]}
                history.record(request, "device.bandwidth_override", device, changes=change)
        if changes:
            messages.success(request, f"Saved {len(changes)} figure(s) for {node.name}.")
        else:
            messages.info(request, "Nothing changed.")
        return redirect(node)
    return render(
        request,
        "calibration/bandwidth_form.html",
        {"node": node, "form": form},
        status=400 if form.errors else 200,
    )
