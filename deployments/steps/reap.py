"""The `reap` step: end the stale llama.cpp processes of ours that hold a port the deployment needs,
by PID, and never anybody else's."""

from __future__ import annotations

from django.conf import settings

from deployments.models import ACTIVE_STATES, Deployment, ResourceClaim
from deployments.steps.common import audit_step
from jobs.aio import db
from jobs.context import JobFailed
from llamacpp.reaper import ForeignHolder, PortStillBusy, find_holders, reap_port


def _owner_of(node, port: int, pid: int) -> str:
    """Which active deployment holds this port or PID of the node ("" when none does)."""

    claim = (
        ResourceClaim.objects.active()
        .filter(node=node, resource=f"port:{port}")
        .select_related("deployment")
        .first()
    )
    if claim is not None:
        return f"port {port} is claimed by deployment {claim.deployment}"
    for deployment in Deployment.objects.filter(state__in=ACTIVE_STATES):
        for info in (deployment.processes or {}).values():
            if info.get("node") == node.name and int(info.get("pid") or 0) == pid:
                return f"PID {pid} is {info.get('role')} of deployment {deployment}"
    return ""


async def reap_pid(ctx, port: int, pid: int) -> str:
    """The one-click reap of a stale process: end exactly that PID, and only while it still holds the port,
    still runs one of our programs, and no active deployment claims the port or the PID. Whatever else
    holds the port now is left alone (the PID the scan saw may have ended and the port found a new owner)."""
    holders = await find_holders(ctx.transport, ctx.node.platform, port)
    holder = next((h for h in holders if h.pid == pid), None)
    if holder is None:
        await ctx.log(f"PID {pid} no longer holds port {port}; nothing was ended")
        return f"{ctx.node.name}: PID {pid} no longer holds port {port}; nothing to do"
    if not holder.ours:
        raise JobFailed(f"{ctx.node.name}: PID {pid} is not ours now ({holder.describe()}); not touched")
    owner = await db(_owner_of)(ctx.node, port, pid)
    if owner:
        raise JobFailed(f"{ctx.node.name}: {owner}; PID {pid} not touched")
    await ctx.log(f"port {port}: stale {holder.kind} PID {pid} ({holder.cmdline}); sending TERM")
    if not await ctx.transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S):
        raise JobFailed(f"{ctx.node.name}: {holder.kind} PID {pid} did not end")
    await db(audit_step)(
        ctx.job,
        "process.reaped",
        ctx.node,
        {"pid": pid, "port": port, "program": holder.kind, "cmdline": holder.cmdline[:300]},
    )
    return f"{ctx.node.name}: port {port}: reaped {holder.kind} PID {pid}"


async def reap_body(ctx) -> str:
    """End stale rpc-server/llama-server processes holding the given ports; fail naming any foreign holder.
    With params["pid"] (the dashboard's reap button), only that process is ended (see reap_pid)."""
    ports = [int(p) for p in ctx.job.params.get("ports") or [ctx.node.rpc_port]]
    if ctx.job.params.get("pid"):
        return await reap_pid(ctx, ports[0], int(ctx.job.params["pid"]))
    platform = ctx.node.platform
    summaries = []
    for port in ports:
        try:
            outcome = await reap_port(
                ctx.transport, platform, port, log=ctx.log, grace=settings.RAMDECK_KILL_GRACE_S
            )
        except (ForeignHolder, PortStillBusy) as exc:
            raise JobFailed(f"{ctx.node.name}: {exc}") from exc
        for holder in outcome.reaped:
            await db(audit_step)(
                ctx.job,
                "process.reaped",
                ctx.node,
                {"pid": holder.pid, "port": port, "program": holder.kind, "cmdline": holder.cmdline[:300]},
            )
        summaries.append(outcome.summary)
    return f"{ctx.node.name}: " + "; ".join(summaries)
