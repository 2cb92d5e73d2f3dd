"""Calibration figures into the database: a node's and its devices' measured figures stored in one
transaction, and a calibration job queued unless one is under way."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from audit import history
from jobs.models import Job
from nodes.models import Node
from remote.text import printable_json

# The job kind, registered in CalibrationConfig.ready().
CALIBRATE = "calibrate"


def store(node, results: dict) -> list[str]:
    """Write the figures to the node and its devices in one transaction; one summary line per figure.

    The fixed costs (calibration/fit.py `FixedCosts`) come from the tiny model's runs."""
    lines = []
    fixed = results.get("fixed_costs") or {}
    hop, overhead, pipeline = fixed.get("hop_ms"), fixed.get("pass_ms"), fixed.get("pipeline_ms")
    local = results.get("local") or {}
    link = results.get("link") or {}
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        for device in locked.devices.all():
            figures = results["devices"].get(device.name)
            if figures is None:
                continue
            bandwidth = figures["bandwidth_gbs"]
            device.record_measurement(
                bandwidth_gbs=bandwidth,
                overhead_ms=figures["overhead_ms"],
                local_bandwidth_gbs=local.get("bandwidth_gbs") if device.name == "CPU" else None,
                prompt_gflops=figures.get("prompt_gflops"),
            )
            table = f" (table {device.bandwidth_gbs:g})" if device.bandwidth_gbs else ""
            if bandwidth is None:
                lines.append(f"{device.name}: too fast to tell apart with the calibration models{table}")
            else:
                lines.append(f"{device.name}: {bandwidth:.1f} GB/s{table}")
            if figures.get("prompt_gflops"):
                speeds = figures.get("prompt_tokens_per_s") or []
                median = (
                    f" ({sorted(speeds)[len(speeds) // 2]:.0f} tokens/s of the calibration model)"
                    if speeds
                    else ""
                )
                lines.append(f"{device.name}: prompts {figures['prompt_gflops']:.0f} GFLOP/s{median}")
            if device.name == "CPU" and local.get("bandwidth_gbs"):
                lines.append(f"CPU inside llama-server: {local['bandwidth_gbs']:.1f} GB/s")
        locked.calibrated_at = timezone.now()
        locked.pass_overhead_ms = overhead
        locked.rpc_hop_ms = hop
        locked.pipeline_overhead_ms = pipeline
        locked.link_rtt_ms = link.get("rtt_ms")
        locked.link_throughput_mbs = link.get("throughput_mbs")
        measured_at = timezone.now().isoformat()
        locked.coordinator_links = {
            pk: {**figure, "source": "calibration", "measured_at": measured_at}
            for pk, figure in (results.get("coordinator_links") or {}).items()
        }
        # The raw samples carry what the node's servers said (the RPC protocol of the link, ...).
        locked.calibration = printable_json(results)
        locked.save(
            update_fields=[
                "calibrated_at",
                "pass_overhead_ms",
                "rpc_hop_ms",
                "pipeline_overhead_ms",
                "link_rtt_ms",
                "link_throughput_mbs",
                "coordinator_links",
                "calibration",
            ]
        )
    if overhead is not None:
        lines.append(
            f"pass {overhead:.2f} ms per token, RPC hop {hop or 0:.2f} ms, "
            f"split across servers {pipeline or 0:.2f} ms"
        )
    if link.get("rtt_ms") is not None:
        via = {"tunnel": " (through an SSH tunnel)", "firewall": " (direct, behind a firewall rule)"}
        lines.append(
            f"link {link['rtt_ms']:.2f} ms round trip, {link.get('throughput_mbs') or '?'} MB/s"
            f"{via.get(results.get('link_protection') or '', '')}"
        )
    for figure in (results.get("coordinator_links") or {}).values():
        lines.append(f"link from coordinator {figure['coordinator']} {figure['rtt_ms']:.2f} ms round trip")
    return lines


def serving(node) -> list:
    """The deployments that hold the node now: from the moment one prepares until it stops or fails
    (deployments/models/claims.py), reached through the node's claims without importing that app."""
    claims = node.claims.active().select_related("deployment").order_by("deployment_id")
    return list({claim.deployment_id: claim.deployment for claim in claims}.values())


def refusal(node, *, besides=None) -> str:
    """Why this node cannot be calibrated now, or "". `besides`: a deployment that stops before the
    calibration (the run page's "stop, calibrate, start again"), whose hold on the node does not count."""
    if node.platform == "windows":
        return (
            f"{node.name} runs Windows, where calibration is not built yet: its figures come from the table."
        )
    if node.current_build is None:
        return f"{node.name} has no llama.cpp build: build or register one on its page first."
    if not node.devices.exists():
        return f"{node.name} has no devices on record: probe it first."
    others = [d for d in serving(node) if besides is None or d.pk != besides.pk]
    if others:
        return (
            f"{node.name} serves deployment {others[0].name}: a calibration would disturb it and needs its "
            "RPC port. Stop the deployment first."
        )
    return ""


def locked_refusal(node, *, besides=None) -> str:
    """`refusal`, checked under the node's row lock (the calibration job's first act, once it runs): a
    deployment claims its nodes under the same lock after checking that no calibration runs on them
    (deployments/lifecycle/actions.py `start_deploy`), so the two never both pass in the same instant."""
    with transaction.atomic():
        Node.objects.select_for_update().filter(pk=node.pk).first()
        return refusal(node, besides=besides)


def start_calibration(node, *, user=None):
    """Queue a calibration of `node` unless one is already queued or running, or it cannot run now (the
    caller says why, from `refusal`): a job sure to fail is never created. The job, or None."""
    with transaction.atomic():
        Node.objects.select_for_update().filter(pk=node.pk).first()
        if Job.objects.active().filter(node=node, kind=CALIBRATE).exists():
            return None
        if refusal(node):
            return None
        job = Job.objects.create(kind=CALIBRATE, node=node, title=f"Calibrate {node.name}", created_by=user)
        job.enqueue()
    return job


def calibrate_after_first_build(build) -> str:
    """After a node's build is recorded (builds/job.py `after_recorded`): a node that was never calibrated is
    calibrated now, so the first plan it is in rests on measurements rather than the table. Queued as the
    build's own creator and audited; a sentence for the build's log, or "" when the node has its figures or a
    calibration is already under way."""
    node = Node.objects.get(pk=build.node_id)
    if node.calibrated_at is not None:
        return ""
    build_job = Job.objects.select_related("created_by").filter(pk=build.job_id).first()
    user = build_job.created_by if build_job else None
    with transaction.atomic():
        job = start_calibration(node, user=user)
        if job is not None:
            history.record(user, "node.calibrate", node, changes={"job": job.pk, "after_build": build.pk})
    if job is not None:
        return f"{node.name} has never been calibrated: calibrating it now (job {job.pk})."
    if reason := refusal(node):
        return f"{node.name} has never been calibrated, and cannot be now: {reason}"
    return ""
