"""The periodic check of running deployments: a dead rpc-server or llama-server makes the deployment degraded.

Called from Celery beat (deployments.tasks.check_deployments). One asyncio run per check; each node is
asked once, for all the PIDs it should have, and the last lines of a dead process's log go into the reason.
"""

from __future__ import annotations

import asyncio
import logging

from jobs.audit import record
from jobs.transport import TransportError
from nodes.models import Node

from .models import Deployment, DeploymentState

logger = logging.getLogger(__name__)

LOG_LINES = 15


async def _check_node(node: Node, processes: list[dict]) -> dict[int, str]:
    """{pid: reason} for the processes on `node` that are gone (or that cannot be checked)."""
    from jobs.runner import open_transport_for

    dead: dict[int, str] = {}
    try:
        async with await open_transport_for(node) as transport:
            for info in processes:
                pid = int(info["pid"])
                if await transport.pid_alive(pid):
                    continue
                tail = await transport.run(["tail", "-n", str(LOG_LINES), info["log"]], timeout=30)
                lines = "\n".join(line.text for line in tail.lines)
                dead[pid] = (
                    f"{info['role']} on {node.name} (PID {pid}) is not running. Last log lines:\n{lines}"
                )
    except TransportError as exc:
        for info in processes:
            dead[int(info["pid"])] = f"{node.name} cannot be reached to check {info['role']}: {exc}"
    return dead


async def _check(groups: dict[Node, list[dict]]) -> dict[int, str]:
    results = await asyncio.gather(*(_check_node(node, procs) for node, procs in groups.items()))
    merged: dict[int, str] = {}
    for item in results:
        merged.update(item)
    return merged


def check_deployment(deployment: Deployment) -> str:
    """Check one deployment now; returns the reason it became degraded, or "" when all is alive."""
    processes = list((deployment.processes or {}).values())
    nodes = {
        n.name: n
        for n in Node.objects.select_related("credential").filter(name__in={p["node"] for p in processes})
    }
    groups: dict[Node, list[dict]] = {}
    for info in processes:
        if info["node"] in nodes:
            groups.setdefault(nodes[info["node"]], []).append(info)
    dead = asyncio.run(_check(groups)) if groups else {}
    if not dead:
        return ""
    reason = "\n\n".join(dead.values())
    if deployment.mark_degraded(reason):
        record(
            None, "deployment.degraded", deployment, changes={"reason": reason[:1000]}, actor_name="monitor"
        )
    return reason


def check_all() -> list[int]:
    """Check every running deployment; the ids of those that became degraded."""
    degraded = []
    for deployment in Deployment.objects.filter(state=DeploymentState.RUNNING).select_related("coordinator"):
        try:
            if check_deployment(deployment):
                degraded.append(deployment.pk)
        except Exception:  # noqa: BLE001 - one broken deployment must not stop the check of the others.
            logger.exception("Checking deployment %s failed.", deployment.pk)
    return degraded
