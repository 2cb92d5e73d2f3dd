"""The `stop` step: end by PID what the deployment started on a node, after checking each is still ours."""

from __future__ import annotations

from django.conf import settings

from deployments.models import Deployment
from jobs.aio import db
from jobs.context import JobFailed
from llamacpp.reaper import (
    ForeignHolder,
    PortStillBusy,
    reap_port,
    runs_our_program,
)
from nodes.guards import remove_guard


async def stop_body(ctx) -> str:
    """End this deployment's processes on the node by PID, then confirm their ports are free."""
    processes = ctx.job.params.get("processes", [])
    platform = ctx.node.platform
    # The processes table shows what this step found of each process as soon as it knows.
    outcome = db(_outcome_recorder(ctx.job.params.get("deployment")))
    done = []
    for info in processes:
        pid = int(info["pid"])
        alive = await ctx.transport.pid_alive(pid)
        note = "was not running when it was stopped"
        if alive:
            ours, cmdline = await runs_our_program(ctx.transport, platform, pid, info["role"])
            if not ours:
                await ctx.log(f"PID {pid} now runs another program ({cmdline or 'gone'}); not touched")
                alive = False
                note = "had ended: its PID now runs another program"
        if alive:
            await ctx.log(f"ending {info['role']} PID {pid}")
            gone = await ctx.transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S)
            if not gone:
                await outcome(ctx.node.name, pid, alive=True, note="did not end when it was stopped")
                raise JobFailed(f"{info['role']} PID {pid} on {ctx.node.name} did not end")
            await outcome(ctx.node.name, pid, alive=False, note="ended by the console")
            done.append(f"{info['role']} PID {pid} ended")
        else:
            await outcome(ctx.node.name, pid, alive=False, note=note)
            await ctx.log(f"{info['role']} PID {pid} was not running")
            done.append(f"{info['role']} PID {pid} already gone")
        files = [f for f in (info.get("key_file"), *info.get("files", [])) if f]
        if files:
            await ctx.transport.run(["rm", "-f", *files], timeout=30)
        # What else holds the port now? A leftover of ours is reaped; a foreign holder fails the stop.
        try:
            await reap_port(ctx.transport, platform, int(info["port"]), log=ctx.log)
        except (ForeignHolder, PortStillBusy) as exc:
            raise JobFailed(str(exc)) from exc
    for guard in ctx.job.params.get("guards", []):
        note = await remove_guard(ctx, guard)
        await ctx.log(note)
        done.append(note)
    return f"{ctx.node.name}: " + ("; ".join(done) or "nothing to stop")


def _outcome_recorder(deployment_id: int | None):
    def record(node: str, pid: int, *, alive: bool, note: str) -> None:
        deployment = Deployment.objects.filter(pk=deployment_id).first() if deployment_id else None
        if deployment is not None:
            deployment.record_process_outcome(node, pid, alive=alive, note=note)

    return record
