"""The "probe" job: discover a node's hardware and store it. Started by an operator or by Celery beat."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction

from audit import history
from jobs.aio import db, run_to_completion
from jobs.context import JobFailed
from jobs.models import Job
from nodes import cache
from nodes.models import Node, Reachability
from nodes.probe.collect import ProbeUnsupported, apply_probe_report, collect, record_probe_failure
from nodes.probe.parse import ProbeReport
from nodes.transports import transport_for
from remote.base import CommandTimeout, HostKeyChanged, HostKeyUnknown, TransportError

if TYPE_CHECKING:
    from jobs.context import JobContext

GIB = 1024**3
# The job kind registered in NodesConfig.ready().
PROBE = "probe"


def start_probe(node: Node, *, user=None, register_detected: bool = False) -> Job | None:
    """Queue a probe of `node` unless one is already queued or running; the job, or None when skipped.

    `register_detected`: when the probe finds a llama.cpp install no build records yet, it queues the build
    job that records it (source "existing": nothing is compiled). "Add this machine" and the probe after a
    host key's approval ask for that."""
    with transaction.atomic():
        # Lock the node row so two callers (beat and a button) cannot both pass the check.
        Node.objects.select_for_update().filter(pk=node.pk).first()
        if Job.objects.active().filter(node=node, kind=PROBE).exists():
            return None
        params = {"register_detected": True} if register_detected else {}
        job = Job.objects.create(
            kind=PROBE, node=node, title=f"Probe {node.name}", params=params, created_by=user
        )
        job.enqueue()
    return job


def start_detected_install_build(node: Node, *, user=None, request=None) -> Job | None:
    """Queue the build job that records the llama.cpp install the last probe found on `node` (nothing is
    compiled: the job runs the binaries for their version and RPC protocol). None when there is nothing
    new to record or a build of the node is already queued or running. Audited."""

    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        folder = locked.detected_install_dir
        if not locked.detected_install_unrecorded:
            return None
        if Job.objects.active().filter(node=locked, kind="build").exists():
            return None
        params = {"source": "existing", "path": folder, "backend": "auto", "rebuild": False}
        job = Job.objects.create(
            kind="build",
            node=locked,
            title=f"Use the detected llama.cpp in {folder} on {locked.name}",
            params=params,
            created_by=user,
        )
        history.record(request or user, "build.requested", locked, changes={**params, "detected": True})
        job.enqueue()
    return job


def periodic_probe(node: Node, now) -> Job | None:
    """Celery beat's probe of one node. A node that answers gets a probe job every round. An offline one is
    only looked at when its backoff has passed (`Node.next_probe_at`), and then quietly: the console opens
    an SSH connection, without a job, and queues the probe job only once the node answers again. So a
    machine switched off for the night is one line on the dashboard and one audit entry, not a failed job
    every few minutes. Returns the probe job, or None."""
    if node.unreachable_since is not None and not node.is_local:
        due = node.next_probe_at()
        # Half a round early counts as due: beat's rounds and the look's own time never line up exactly.
        if due is not None and now + timedelta(seconds=settings.RAMDECK_PROBE_INTERVAL_S / 2) < due:
            return None
        if not answers_again(node):
            return None
    return start_probe(node)


def answers_again(node: Node) -> bool:
    """Does the offline node let the console in over SSH now? A refusal keeps the reason current on the
    node (its transport records it) and counts as a look for the backoff."""

    async def connect(transport) -> None:
        async with transport:
            pass

    try:
        transport = transport_for(node)
        run_to_completion(lambda: connect(transport))
    except (HostKeyUnknown, HostKeyChanged):
        return False  # it answers, with a key an admin must look at: the transport stored it for review
    except TransportError as exc:
        node.mark_unreachable(str(exc), probed=True)
        return False
    return True


async def probe(ctx: JobContext) -> str:
    node = ctx.node
    if node is None:
        raise JobFailed("A probe needs a node.")
    await ctx.log(f"Probing {node.name} ({node.address}) ...")
    try:
        build = await db(lambda: node.current_build)()
        report = await collect(
            ctx.transport,
            node.platform_hint,
            rpc_port=node.rpc_port,
            known_server=(build.llama_server_path, build.version) if build and build.version else None,
        )
    except ProbeUnsupported as exc:
        await db(record_probe_failure)(node, str(exc))
        raise JobFailed(str(exc)) from exc
    except CommandTimeout as exc:
        await db(record_probe_failure)(node, str(exc))
        raise
    except TransportError as exc:
        await db(record_probe_failure)(node, str(exc), reachability=Reachability.UNREACHABLE)
        raise
    for line in summary_lines(report, build.llama_server_path if build else ""):
        await ctx.log(line)
    devices = await db(apply_probe_report)(node, report)
    # The RPC cache's size and the free disk, for the node page; a probe does not fail for want of them.
    with contextlib.suppress(JobFailed, TransportError):
        await cache.run_script(ctx, node, "usage")
    if (ctx.job.params or {}).get("register_detected"):
        job = ctx.job
        build_job = await db(lambda: start_detected_install_build(node, user=job.created_by))()
        if build_job is not None:
            await ctx.log(f"Recording the llama.cpp install it found as a build (job {build_job.pk}).")
    if not devices:
        raise JobFailed("The probe found no device llama.cpp could use on this node.")
    names = ", ".join(f"{d.name} {d.free_bytes / GIB:.1f}/{d.total_bytes / GIB:.1f} GiB" for d in devices)
    return f"{report.os_name or report.platform}; {names}; RTT {report.rtt_ms:g} ms."


def summary_lines(report: ProbeReport, registered: str = "") -> list[str]:
    """What the probe found, for the job log (a person skims it). `registered`: the llama-server of the
    node's build, which may be in a folder the probe does not look in."""
    lines = [
        f"System: {report.os_name} ({report.platform}), kernel {report.kernel}, {report.arch}",
        f"CPU: {report.cpu_model or 'unknown'}, {report.cpu_cores} cores",
        f"RAM: {report.ram_available_bytes / GIB:.1f} GiB available of {report.ram_total_bytes / GIB:.1f} GiB"
        + (
            f" (container limit {report.memory_limit_bytes / GIB:.1f} GiB)"
            if report.memory_limit_bytes
            else ""
        ),
    ]
    for device in report.devices:
        speed = f", {device.bandwidth_gbs:g} GB/s" if device.bandwidth_gbs else ""
        unified = ", unified memory" if device.unified_memory else ""
        if device.wired_limit_bytes:
            unified += f", wired limit {device.wired_limit_bytes / GIB:.1f} GiB"
        lines.append(
            f"Device {device.name}: {device.description}, {device.free_bytes / GIB:.1f} of "
            f"{device.total_bytes / GIB:.1f} GiB free{speed}{unified}"
        )
    if report.rpc_server_binary or report.binaries.get("llama-server"):
        version = f" (version {report.llama_version})" if report.llama_version else ""
        lines.append(f"llama.cpp: {', '.join(sorted(report.binaries))}{version}")
    elif registered:
        lines.append(f"llama.cpp: the registered build, {registered} (not on the PATH)")
    else:
        lines.append("llama.cpp: not found on this node (build it from the node page).")
    if report.rpc_port_in_use:
        lines.append(
            f"RPC port {report.rpc_port} is in use by {report.rpc_port_process or 'a process'}"
            + (f" (PID {report.rpc_port_pid})" if report.rpc_port_pid else "")
        )
    if report.rtt_ms is not None:
        lines.append(f"Round trip: {report.rtt_ms:g} ms")
    lines.extend(f"Note: {warning}" for warning in report.warnings)
    return lines
