"""The `preflight` step: before llama-server starts, the coordinator itself connects to each worker's
ggml-rpc-server (or its tunnel's local end), says HELLO and times a few requests (llamacpp/rpc_reach.py).

A worker the coordinator cannot reach stops the deployment here, with a reason that names the node, the
port, the likely cause and the command, in the worker OS's own words, that lets the coordinator in; the run
rolls back what it started. Without it the same fault shows up later as llama-server failing to load, with
a log to read. The round trips are logged, kept on the step's params, and stored per coordinator–worker
pair on the worker (Node.coordinator_links), where the planner takes them for the next plan."""

from __future__ import annotations

from deployments.steps.common import load_deployment
from deployments.steps.llama_server import local_ends
from jobs.aio import db
from jobs.context import JobFailed
from llamacpp.rpc_reach import (
    FIREWALL_TOOL_ARGV,
    LINUX_FIREWALLS,
    firewall_fix,
    likely_cause,
    parse_reach,
    reach_argv,
)
from nodes.models import Node
from nodes.transports import transport_for
from remote.base import TransportError


def _workers(names: list[str]) -> dict[str, Node]:
    return {node.name: node for node in Node.objects.filter(name__in=names)}


def _rpc_path(node: Node) -> str:
    build = node.current_build
    return build.rpc_server_path if build is not None else ""


async def _fix_on(ctx, node: Node | None, coordinator_ip: str, port: int) -> str:
    """The worker's own command that lets the coordinator in: for Linux, in the words of the firewall front
    end it has (asked over the console's connection to it)."""
    if node is None:
        return firewall_fix("linux", coordinator_ip, port)
    tool = ""
    if node.platform == "linux":
        try:
            async with await db(transport_for)(node) as transport:
                found = (await transport.run(FIREWALL_TOOL_ARGV, timeout=30)).stdout.strip()
            tool = found if found in LINUX_FIREWALLS else ""
        except TransportError as exc:
            await ctx.log(f"could not ask {node.name} which firewall it has: {exc}")
    rpc_path = await db(_rpc_path)(node)
    return firewall_fix(node.platform, coordinator_ip, port, rpc_path, tool=tool)


async def preflight_body(ctx) -> str:
    deployment = await load_deployment(ctx)
    if ctx.node.platform == "windows":
        # The client is a perl one-liner; Windows has no perl by default.
        await ctx.log(f"{ctx.node.name} is a Windows coordinator: its reach to the workers is not checked")
        return "not checked: the coordinator runs Windows"
    targets = ctx.job.params.get("targets") or []
    ends = local_ends(ctx, deployment)
    workers = await db(_workers)([t["node"] for t in targets])
    coordinator_ip = ctx.job.params.get("coordinator_ip") or ""
    figures = []
    for target in targets:
        name, endpoint, port = target["node"], target["endpoint"], int(target["port"])
        tunnel = bool(target.get("tunnel"))
        host, _, reach_port = ends.get(endpoint, endpoint).rpartition(":")
        via = f" through its tunnel ({host}:{reach_port})" if tunnel else ""
        try:
            result = await ctx.transport.run(reach_argv(host, int(reach_port)), timeout=60)
        except TransportError as exc:
            # No perl on the coordinator: the check cannot run, which says nothing about the worker.
            await ctx.log(f"WARNING: {name}:{port}{via} not checked: {exc}")
            continue
        reach = parse_reach(result.stdout or "\n".join(line.text for line in result.lines))
        if reach.stage == "run":
            await ctx.log(f"WARNING: {name}:{port}{via} not checked: the check did not run ({reach.reason})")
            continue
        if not reach.ok:
            node = workers.get(name)
            if tunnel:
                fix = (
                    f"on {name}, allow TCP forwarding for the console's SSH user in sshd_config "
                    "(AllowTcpForwarding yes), or choose direct mode"
                )
            else:
                fix = f"on {name}: {await _fix_on(ctx, node, coordinator_ip, port)}"
            raise JobFailed(
                f"{ctx.node.name} cannot reach {name}'s ggml-rpc-server on port {port}{via} "
                f"({reach.stage}: {reach.reason}). Likely cause: {likely_cause(reach, tunnel=tunnel)}. "
                f"To let the coordinator in, run {fix}."
            )
        timed = (
            f"round trip {reach.rtt_ms:g} ms" if reach.rtt_ms is not None else "not timed (no Time::HiRes)"
        )
        await ctx.log(f"{ctx.node.name} → {name}:{port}{via}: RPC {reach.protocol} answers, {timed}")
        figures.append({"node": name, "port": port, "connect_ms": reach.connect_ms, "rtt_ms": reach.rtt_ms})
        worker = workers.get(name)
        if worker is not None and worker.pk != ctx.node.pk and reach.rtt_ms is not None:
            # The pair's round trip as llama-server will pay it: the next plan with this coordinator uses it.
            await db(worker.record_coordinator_link)(ctx.node, reach.rtt_ms, "preflight")
    ctx.job.params["reached"] = figures
    await db(ctx.job.save)(update_fields=["params"])
    listed = ", ".join(
        f"{f['node']} {f['rtt_ms']:g} ms" if f["rtt_ms"] is not None else f["node"] for f in figures
    )
    return f"{ctx.node.name} reaches every worker it checked: {listed or 'none'}"
