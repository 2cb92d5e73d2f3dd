"""The periodic check of running deployments: a dead rpc-server or llama-server makes the deployment degraded.

Called from Celery beat (deployments.tasks.check_deployments). One asyncio run per check; each node is
asked once, for all the PIDs it should have, and the last lines of a dead process's log go into the reason.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from django.utils import timezone

from deployments.reaper import Holder, find_holders
from jobs.audit import record
from jobs.transport import TransportError, open_transport
from nodes.models import Node

from .models import ACTIVE_STATES, Deployment, DeploymentState, StaleProcess

logger = logging.getLogger(__name__)

LOG_LINES = 15
HEALTH_TIMEOUT_S = 10.0


def _transport(node: Node):
    """Made in synchronous code: the factory reads the node's credential from the database, which must not
    happen from inside the short event loop below (a view's thread may be the database thread)."""
    try:
        return open_transport(node)
    except TransportError as exc:
        return exc


async def _check_node(node: Node, opened, processes: list[dict]) -> dict[int, str]:
    """{pid: reason} for the processes on `node` that are gone (or that cannot be checked). A PID alive
    but running another program (reused after ours ended) counts as gone."""
    from .lifecycle_steps import node_platform, runs_our_program

    dead: dict[int, str] = {}
    try:
        if isinstance(opened, TransportError):
            raise opened
        async with opened as transport:
            for info in processes:
                pid = int(info["pid"])
                if await transport.pid_alive(pid):
                    ours, cmdline = await runs_our_program(transport, node_platform(node), pid, info["role"])
                    if ours:
                        continue
                    dead[pid] = (
                        f"{info['role']} on {node.name} (PID {pid}) is not running: that PID now runs "
                        f"another program ({cmdline[:200]})."
                    )
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


async def _check(groups: dict[Node, list[dict]], transports: dict) -> dict[int, str]:
    results = await asyncio.gather(
        *(_check_node(node, transports[node.name], procs) for node, procs in groups.items())
    )
    merged: dict[int, str] = {}
    for item in results:
        merged.update(item)
    return merged


def processes_by_node(deployment: Deployment) -> dict[Node, list[dict]]:
    """The deployment's recorded processes grouped by their node (nodes since deleted are left out)."""
    processes = list((deployment.processes or {}).values())
    nodes = {
        n.name: n
        for n in Node.objects.select_related("credential").filter(name__in={p["node"] for p in processes})
    }
    groups: dict[Node, list[dict]] = {}
    for info in processes:
        if info["node"] in nodes:
            groups.setdefault(nodes[info["node"]], []).append(info)
    return groups


def check_deployment(deployment: Deployment) -> str:
    """Check one deployment now; returns the reason it became degraded, or "" when all is alive."""
    groups = processes_by_node(deployment)
    transports = {node.name: _transport(node) for node in groups}
    dead = asyncio.run(_check(groups, transports)) if groups else {}
    problems = list(dead.values()) or _unhealthy(deployment)
    if not problems:
        # Everything answers again (a node that was unreachable for a while is back): running again.
        if deployment.state == DeploymentState.DEGRADED and deployment.mark_recovered():
            record(None, "deployment.recovered", deployment, actor_name="monitor")
        return ""
    reason = "\n\n".join(problems)
    if deployment.state == DeploymentState.DEGRADED:
        deployment.record(state_reason=reason)  # still degraded; keep the reason current
    elif deployment.mark_degraded(reason):
        record(
            None, "deployment.degraded", deployment, changes={"reason": reason[:1000]}, actor_name="monitor"
        )
    return reason


def _unhealthy(deployment: Deployment) -> list[str]:
    """llama-server is alive: does it still answer /health? (A wedged server is as bad as a dead one.)"""
    from .lifecycle_steps import endpoint_url

    url = f"{endpoint_url(deployment)}/health"
    try:
        response = httpx.get(url, timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return [f"llama-server does not answer {url}: {exc}"]
    if response.status_code != 200:
        return [f"llama-server answers {url} with {response.status_code}: {response.text[:200]}"]
    return []


def check_all() -> list[int]:
    """Check every running or degraded deployment; the ids of those that are degraded now."""
    degraded = []
    watched = (DeploymentState.RUNNING, DeploymentState.DEGRADED)
    for deployment in Deployment.objects.filter(state__in=watched).select_related("coordinator"):
        try:
            if check_deployment(deployment):
                degraded.append(deployment.pk)
        except Exception:  # noqa: BLE001 - one broken deployment must not stop the check of the others.
            logger.exception("Checking deployment %s failed.", deployment.pk)
    return degraded


# --------------------------------------------------------------------------------------------------
# Process status for the deployment page
# --------------------------------------------------------------------------------------------------


def parse_ps_status(text: str) -> dict[int, dict]:
    """{pid: {"uptime_s", "rss_bytes"}} from `ps -o pid=,etimes=,rss= -p PIDS` (rss in KiB)."""
    status = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            status[int(parts[0])] = {"uptime_s": int(parts[1]), "rss_bytes": int(parts[2]) * 1024}
    return status


async def _status_of_node(opened, processes: list[dict]) -> list[dict]:
    pids = ",".join(str(int(p["pid"])) for p in processes)
    try:
        if isinstance(opened, TransportError):
            raise opened
        async with opened as transport:
            result = await transport.run(["ps", "-o", "pid=,etimes=,rss=", "-p", pids], timeout=30)
            found = parse_ps_status(result.stdout)
            error = ""
    except TransportError as exc:
        found, error = {}, str(exc)
    rows = []
    for info in processes:
        pid = int(info["pid"])
        rows.append({**info, "alive": pid in found, **found.get(pid, {}), "error": error})
    return rows


def process_status(deployment: Deployment) -> list[dict]:
    """Every process this deployment started, with whether it is alive, its uptime and resident memory."""
    groups = processes_by_node(deployment)
    transports = {node: _transport(node) for node in groups}

    async def gather() -> list[list[dict]]:
        return await asyncio.gather(
            *(_status_of_node(transports[node], procs) for node, procs in groups.items())
        )

    rows = [row for group in (asyncio.run(gather()) if groups else []) for row in group]
    return sorted(rows, key=lambda r: (r["role"] != "llama-server", r["node"]))


# --------------------------------------------------------------------------------------------------
# Stale processes: ours, holding a port, owned by no active deployment
# --------------------------------------------------------------------------------------------------


def _ports_to_scan(node: Node) -> set[int]:
    """The node's RPC port and every llama-server port a deployment coordinated from it has used."""
    ports = {node.rpc_port}
    ports.update(Deployment.objects.filter(coordinator=node).values_list("port", flat=True).distinct())
    return ports


def _owned_pids() -> set[tuple[str, int]]:
    owned = set()
    for processes in Deployment.objects.filter(state__in=ACTIVE_STATES).values_list("processes", flat=True):
        for info in (processes or {}).values():
            owned.add((info["node"], int(info["pid"])))
    return owned


async def _holders_on(opened, platform: str, ports: set[int]) -> list[tuple[int, Holder]] | TransportError:
    try:
        if isinstance(opened, TransportError):
            raise opened
        async with opened as transport:
            found = []
            for port in sorted(ports):
                found += [(port, holder) for holder in await find_holders(transport, platform, port)]
            return found
    except TransportError as exc:
        return exc


def scan_stale() -> int:
    """Record every stale process of ours on enabled nodes (and forget those gone). Returns how many."""
    from .lifecycle_steps import node_platform

    nodes = list(Node.objects.filter(enabled=True).select_related("credential"))
    work = {n.name: (n, _transport(n), _ports_to_scan(n)) for n in nodes}

    async def gather():
        names = list(work)
        results = await asyncio.gather(
            *(_holders_on(work[name][1], node_platform(work[name][0]), work[name][2]) for name in names)
        )
        return dict(zip(names, results, strict=True))

    results = asyncio.run(gather()) if work else {}
    owned = _owned_pids()
    now = timezone.now()
    seen = []
    for name, found in results.items():
        node = work[name][0]
        if isinstance(found, TransportError):
            continue  # Unreachable: keep what we knew; the node page says why.
        keep = []
        for port, holder in found:
            if not holder.ours or holder.pid is None or (name, holder.pid) in owned:
                continue
            row, _ = StaleProcess.objects.update_or_create(
                node=node,
                port=port,
                pid=holder.pid,
                defaults={"program": holder.kind, "cmdline": holder.cmdline[:2000], "last_seen_at": now},
            )
            keep.append(row.pk)
        StaleProcess.objects.filter(node=node).exclude(pk__in=keep).delete()
        seen += keep
    return len(seen)
