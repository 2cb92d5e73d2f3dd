"""The periodic check of running deployments: a dead rpc-server or llama-server makes the deployment degraded.

Called from Celery beat (deployments.tasks.check_deployments). One asyncio run checks every deployment at
once; each node is asked once per deployment, for all the PIDs it should have (alive, still our program,
uptime, resident memory), and the last lines of a dead process's log go into the reason. What it saw,
with llama-server's /metrics numbers, is stored in `Deployment.live_status` for the page to show: no page
view opens an SSH connection or calls a node.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
from django.utils import timezone

from audit.history import record
from deployments import live
from deployments.endpoint import endpoint_url
from deployments.lifecycle import healing
from deployments.models import ACTIVE_STATES, Deployment, DeploymentState, SpeedSample, StaleProcess
from jobs.aio import run_to_completion
from jobs.on_node import tail_argv
from llamacpp.reaper import Holder, find_holders, runs_our_program
from nodes.models import Node
from nodes.transports import transport_for
from remote.base import TransportError
from remote.bounded_http import AnswerTooLarge, fetch
from remote.text import printable

logger = logging.getLogger(__name__)

LOG_LINES = 15
# Speed samples older than this are deleted (the dashboard shows the last hour).
SPEED_SAMPLES_KEPT = timedelta(days=1)
HEALTH_TIMEOUT_S = 10.0
METRICS_SHOWN = (
    "llamacpp:prompt_tokens_total",
    "llamacpp:tokens_predicted_total",
    # With the tokens' total, the decode speed between two looks (SpeedSample): the dashboard's sparkline.
    "llamacpp:tokens_predicted_seconds_total",
    "llamacpp:predicted_tokens_seconds",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
)


def _transport(node: Node):
    """Made in synchronous code: the factory reads the node's credential from the database, which must not
    happen from inside the short event loop below (a view's thread may be the database thread)."""
    try:
        return transport_for(node)
    except TransportError as exc:
        return exc


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


def elapsed_seconds(text: str) -> int | None:
    """Seconds from ps's POSIX `etime` ("[[dd-]hh:]mm:ss"); None when it is not one."""
    days, dash, clock = text.rpartition("-")
    parts = clock.split(":")
    if (dash and not days.isdigit()) or not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def parse_ps_status(text: str) -> dict[int, dict]:
    """{pid: {"uptime_s", "rss_bytes"}} from `ps -o pid=,etime=,rss= -p PIDS` (rss in KiB). `etime` is the
    POSIX keyword, which macOS's ps knows too (procps's `etimes` it does not)."""
    status = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
            continue
        uptime = elapsed_seconds(parts[1])
        if uptime is not None:
            status[int(parts[0])] = {"uptime_s": uptime, "rss_bytes": int(parts[2]) * 1024}
    return status


def parse_metrics(text: str) -> dict[str, str]:
    """The numbers of METRICS_SHOWN from llama-server's Prometheus text, by short name."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS_SHOWN:
            values[name.split(":", 1)[1]] = value.strip()
    return values


def _count(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _plural(count: float, one: str, many: str) -> str:
    return f"{count:,.0f} {one if count == 1 else many}"


def metrics_sentences(metrics: dict) -> list[str]:
    """llama-server's /metrics numbers (parse_metrics' short names) as sentences a household can read."""
    said = []
    prompt = _count(metrics.get("prompt_tokens_total"))
    written = _count(metrics.get("tokens_predicted_total"))
    seconds = _count(metrics.get("tokens_predicted_seconds_total"))
    if written is not None:
        text = f"Since it started it has written {_plural(written, 'token', 'tokens')}"
        if prompt is not None:
            text += f" in answer to {_plural(prompt, 'token', 'tokens')} of questions and conversation"
        if written and seconds:
            text += f", at {written / seconds:.1f} tokens per second on average while writing"
        said.append(text + ".")
    elif (speed := _count(metrics.get("predicted_tokens_seconds"))) is not None:
        said.append(f"It writes at {speed:.1f} tokens per second on average.")
    busy = _count(metrics.get("requests_processing"))
    waiting = _count(metrics.get("requests_deferred"))
    if busy is not None:
        text = (
            "Nobody is waiting for an answer right now"
            if not busy
            else (f"It is answering {_plural(busy, 'request', 'requests')} right now")
        )
        if waiting:
            text += f"; {_plural(waiting, 'more waits', 'more wait')} for a free slot"
        said.append(text + ".")
    return said


@dataclass
class Check:
    """What one deployment's check needs, gathered in synchronous code before the event loop starts."""

    deployment: Deployment
    transports: dict[Node, object]
    groups: dict[Node, list[dict]]
    url: str
    api_key: str


@dataclass
class Seen:
    dead: dict[int, str] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    health: list[str] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)


async def _check_node(node: Node, opened, processes: list[dict]) -> tuple[dict[int, str], list[dict]]:
    """({pid: reason} for the processes on `node` that are gone or cannot be checked, a status row per
    process). A PID alive but running another program (reused after ours ended) counts as gone."""

    dead: dict[int, str] = {}
    status: dict[int, dict] = {}
    error = ""
    platform = node.platform
    try:
        if isinstance(opened, TransportError):
            raise opened
        async with opened as transport:
            for info in processes:
                pid = int(info["pid"])
                if await transport.pid_alive(pid):
                    ours, cmdline = await runs_our_program(transport, platform, pid, info["role"])
                    if ours:
                        continue
                    dead[pid] = (
                        f"{info['role']} on {node.name} (PID {pid}) is not running: that PID now runs "
                        f"another program ({cmdline[:200]})."
                    )
                    continue
                tail = await transport.run(tail_argv(transport, info["log"], LOG_LINES), timeout=30)
                lines = "\n".join(line.text for line in tail.lines)
                dead[pid] = (
                    f"{info['role']} on {node.name} (PID {pid}) is not running. Last log lines:\n{lines}"
                )
            alive = [int(p["pid"]) for p in processes if int(p["pid"]) not in dead]
            if alive and platform != "windows":
                pids = ",".join(map(str, alive))
                result = await transport.run(["ps", "-o", "pid=,etime=,rss=", "-p", pids], timeout=30)
                status = parse_ps_status(result.stdout)
    except TransportError as exc:
        error = str(exc)
        for info in processes:
            dead[int(info["pid"])] = f"{node.name} cannot be reached to check {info['role']}: {exc}"
    rows = []
    for info in processes:
        pid = int(info["pid"])
        alive = not error and pid not in dead
        rows.append({**info, "alive": alive, "error": error, **status.get(pid, {})})
    return dead, rows


async def _health_and_metrics(client: httpx.AsyncClient, check: Check) -> tuple[list[str], dict[str, str]]:
    """llama-server is alive: does it still answer /health? (A wedged server is as bad as a dead one.)
    And its live numbers from /metrics, when it answers them."""
    url = f"{check.url}/health"
    try:
        # Every answer read with a bound (remote/bounded_http.py): the node decides what it sends.
        status, body = await fetch(client, "GET", url, timeout=HEALTH_TIMEOUT_S, what="/health answer")
    except (httpx.HTTPError, AnswerTooLarge) as exc:
        return [f"llama-server does not answer {url}: {exc}"], {}
    if status != 200:
        text = body.decode("utf-8", "replace")[:200]
        return [f"llama-server answers {url} with {status}: {text}"], {}
    metrics: dict[str, str] = {}
    try:
        status, body = await fetch(
            client,
            "GET",
            f"{check.url}/metrics",
            headers={"Authorization": f"Bearer {check.api_key}"},
            timeout=5.0,
            what="/metrics answer",
        )
        if status == 200:
            metrics = parse_metrics(body.decode("utf-8", "replace"))
    except (httpx.HTTPError, AnswerTooLarge):
        pass  # The numbers are a nicety; /health decides the state.
    return [], metrics


async def _observe(client: httpx.AsyncClient, check: Check) -> Seen:
    results = await asyncio.gather(
        *(_check_node(node, check.transports[node], procs) for node, procs in check.groups.items())
    )
    seen = Seen()
    for dead, rows in results:
        seen.dead.update(dead)
        seen.rows += rows
    seen.rows.sort(key=lambda r: (r["role"] != "llama-server", r["node"]))
    if not seen.dead:
        seen.health, seen.metrics = await _health_and_metrics(client, check)
    return seen


async def _observe_all(checks: list[Check]) -> list[Seen | BaseException]:
    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(_observe(client, c) for c in checks), return_exceptions=True)


def _prepare(deployment: Deployment) -> Check:
    groups = processes_by_node(deployment)
    key = deployment.api_key() if deployment.api_key_encrypted else ""
    return Check(deployment, {n: _transport(n) for n in groups}, groups, endpoint_url(deployment), key)


def _apply(deployment: Deployment, seen: Seen) -> str:
    """Store what the check saw, and move the deployment between running and degraded."""
    problems = list(seen.dead.values()) or seen.health
    now = timezone.now().isoformat()
    status = {"checked_at": now, "processes": seen.rows, "metrics": seen.metrics}
    if problems:
        # When it was first seen not working (the dashboard says since when).
        status["down_since"] = (deployment.live_status or {}).get("down_since") or now
    if not deployment.record_live_status(status):
        return ""  # Stopped (or failed) while the monitor looked: what it saw is no longer true.
    if seen.metrics:
        SpeedSample.record(deployment, seen.metrics)
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
    healing.consider(deployment)  # when it opted in
    return reason


def check_deployments(deployments: list[Deployment]) -> dict[int, str]:
    """Check these deployments now, all in one event loop; {pk: reason it is degraded, "" when healthy}."""
    checks = []
    for deployment in deployments:
        try:
            checks.append(_prepare(deployment))
        except Exception:
            logger.exception("Preparing the check of deployment %s failed.", deployment.pk)
    results = run_to_completion(lambda: _observe_all(checks)) if checks else []
    outcome = {}
    for check, seen in zip(checks, results, strict=True):
        try:
            if isinstance(seen, BaseException):
                raise seen
            outcome[check.deployment.pk] = _apply(check.deployment, seen)
        except Exception:
            logger.exception("Checking deployment %s failed.", check.deployment.pk)
    return outcome


def check_deployment(deployment: Deployment) -> str:
    """Check one deployment now; returns the reason it became degraded, or "" when all is alive."""
    return check_deployments([deployment]).get(deployment.pk, "")


def check_all() -> list[int]:
    """Check every running or degraded deployment; the ids of those that are degraded now."""
    watched = (DeploymentState.RUNNING, DeploymentState.DEGRADED)
    deployments = list(Deployment.objects.filter(state__in=watched).select_related("coordinator"))
    SpeedSample.objects.filter(at__lt=timezone.now() - SPEED_SAMPLES_KEPT).delete()
    return [pk for pk, reason in check_deployments(deployments).items() if reason]


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

    nodes = list(Node.objects.filter(enabled=True).select_related("credential"))
    work = {n.name: (n, _transport(n), _ports_to_scan(n)) for n in nodes}

    async def gather():
        names = list(work)
        results = await asyncio.gather(
            *(_holders_on(work[name][1], work[name][0].platform, work[name][2]) for name in names)
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
                # The command line is what the node's ps printed: printable only (remote/text.py).
                defaults={
                    "program": printable(holder.kind, 40),
                    "cmdline": printable(holder.cmdline, 2000),
                    "last_seen_at": now,
                },
            )
            keep.append(row.pk)
        StaleProcess.objects.filter(node=node).exclude(pk__in=keep).delete()
        seen += keep
    live.dashboard_changed()
    return len(seen)
