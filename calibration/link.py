"""A calibration's link figure, measured through the protection a deployment would use on the node.

The console times the node's RPC port with the RPC protocol itself (llamacpp/rpc_wire.py): the round
trip and throughput a coordinator pays to reach the node's ggml-rpc-server. That server has no
authentication, so the one started for this is never open to the network; the node's settings choose how
it is reached, as they choose for a deployment (deployments/lifecycle/actions.py, `rpc_mode`):

- **tunnel** (the node allows RPC tunnels, so a deployment reaches it through one): rpc-server binds
  127.0.0.1 and the console reaches it through its own SSH connection to the node (a direct-tcpip channel:
  `ssh -L` without a listener on the console's side), so the figure carries what the tunnel costs, as a
  tunnel deployment pays it;
- **direct** (the node does not allow tunnels): rpc-server binds the node's RPC address, normalised as a
  direct deployment's is (`nodes.guards.direct_bind`), behind the firewall rule a deployment uses
  (rpc_guard.firewall_rule), admitting only the console's address as the node sees it; the rule goes in
  before the server starts and comes out after the server has ended, whatever happens in between;
- the console's own host: rpc-server binds 127.0.0.1 and is timed there.

The console is not always the coordinator (a NAS or a laptop may run it), so `from_coordinators` also times
the link from each node that may coordinate to this one, on that node: TCP handshakes to this node's SSH
port (open to the coordinator in either mode; one handshake is one network round trip), run there by perl
(llamacpp/rpc_reach.py). The planner uses that pair's figure when that node coordinates.

Where neither protection is available (no tunnels allowed, and the SSH user is neither root nor allowed by
sudo to run the rule's iptables commands, the node has no iptables, or it is not Linux) the link is not
measured, and the job log says why: the port is never opened to the network for a figure.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

import asyncssh

from jobs.aio import db
from jobs.context import JobFailed
from llamacpp import rpc_guard
from llamacpp import rpc_wire as rpc_link
from llamacpp.rpc_reach import handshakes_argv, parse_handshakes
from nodes.guards import direct_bind, may_administer, remove_guard
from nodes.models import Node
from nodes.transports import transport_for
from remote.base import TransportError

TUNNEL, FIREWALL, LOOPBACK = "tunnel", "firewall", "loopback"


async def console_address(ctx) -> str | None:
    """The console's IPv4 address as the node sees it (its sshd's SSH_CONNECTION), or None."""
    result = await ctx.transport.run(["printenv", "SSH_CONNECTION"], timeout=30)
    fields = result.stdout.split()
    if not result.ok or not fields:
        return None
    try:
        address = ipaddress.ip_address(fields[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        address = address.ipv4_mapped
    return str(address) if address is not None else None


async def measure(
    ctx, node, procs, start: Callable[[str], Awaitable[int]]
) -> tuple[rpc_link.LinkFigures | None, str | None]:
    """Start an rpc-server on the node's RPC port through `start(bind address) -> PID` (it returns once the
    server listens), time the link to it, and end it with `procs` (the calibration's processes, of which it
    is the only one still running). Returns the figures (None when not measured) and the protection used
    (TUNNEL, FIREWALL, LOOPBACK; None when the link was not measured)."""
    port = node.rpc_port
    if node.is_local:
        await ctx.log(f"link: ggml-rpc-server listens on 127.0.0.1:{port} (the console's own host)")
        try:
            figures = await _served(ctx, start, "127.0.0.1", "127.0.0.1", port, None)
        finally:
            await procs.end_all()
        return figures, LOOPBACK
    if node.rpc_tunnel:
        await ctx.log(
            f"link: measured through an SSH tunnel, as a deployment reaches {node.name} (it allows RPC "
            f"tunnels): ggml-rpc-server listens on 127.0.0.1:{port} only"
        )

        async def tunnel():
            try:
                return await ctx.transport.open_tunnel(port)
            except TransportError as exc:
                raise ConnectionError(str(exc)) from exc

        try:
            figures = await _served(ctx, start, "127.0.0.1", "127.0.0.1", port, tunnel, via=" through SSH")
        finally:
            await procs.end_all()
        return figures, TUNNEL
    return await _behind_firewall(ctx, node, procs, start)


async def _behind_firewall(ctx, node, procs, start) -> tuple[rpc_link.LinkFigures | None, str | None]:
    port = node.rpc_port
    try:
        bind = direct_bind(node)
    except rpc_guard.BindRefused as exc:
        return await _not_measured(ctx, node, str(exc))
    if node.platform != "linux":
        return await _not_measured(ctx, node, "it is not Linux, where the console sets no firewall rule")
    console = await console_address(ctx)
    if console is None:
        return await _not_measured(ctx, node, "it does not see the console at an IPv4 address")
    tag = rpc_guard.calibration_tag(ctx.job.pk, node.name)
    rule = rpc_guard.firewall_rule(port, console, tag)
    sudo = await may_administer(ctx, rule)
    if sudo is None:
        why = "its SSH user is not root and may not run the firewall rule's iptables commands through sudo -n"
        return await _not_measured(ctx, node, why)
    try:
        result = await ctx.transport.run(rpc_guard.iptables_argv("-I", rule, sudo=sudo), timeout=60)
    except TransportError as exc:  # no iptables at all (a container, a minimal install): exit status 127
        return await _not_measured(ctx, node, f"the firewall rule could not be inserted: {exc}")
    if not result.ok:
        why = f"iptables refused the firewall rule: {result.stderr.strip()[:300] or 'no iptables'}"
        return await _not_measured(ctx, node, why)
    await ctx.log(
        f"link: measured directly, as a deployment reaches {node.name} (it does not allow RPC tunnels): "
        f"firewall rule {tag} admits only the console ({console}) to port {port}, inserted before "
        f"ggml-rpc-server starts on {bind}"
    )
    try:
        figures = await _served(ctx, start, bind, node.rpc_endpoint_host, port, None)
    finally:
        # Whatever happened, the rule comes out once no server of ours is left behind it; a server that
        # did not end keeps it, so that its port stays closed.
        if await procs.end_all():
            note = await remove_guard(ctx, {"kind": "firewall", "rule": rule, "sudo": sudo, "tag": tag})
            await ctx.log(f"link: {note}")
        else:
            await ctx.log(
                f"link: an rpc-server of this calibration did not end; firewall rule {tag} stays on "
                f"{node.name} so that its port stays closed"
            )
    return figures, FIREWALL


async def _served(
    ctx, start, bind: str, host: str, port: int, connect, *, via: str = ""
) -> rpc_link.LinkFigures | None:
    """Time the link to an rpc-server started on `bind`, reached at host:port (through `connect` when
    given). The caller ends the server. A server that does not start costs the link figure only: the
    devices' figures, measured by then, are kept."""
    try:
        await start(bind)
    except JobFailed as exc:
        await ctx.log(f"link not measured: ggml-rpc-server did not start on {bind}:{port}: {exc.reason}")
        return None
    try:
        figures = await rpc_link.measure_link(host, port, connect=connect)
    except (rpc_link.LinkError, asyncssh.Error) as exc:
        await ctx.log(f"link to {host}:{port}{via} not measured: {exc}")
        return None
    await ctx.log(
        f"link console → {host}:{port}{via}: connect {figures.connect_ms:.2f} ms, RPC round trip "
        f"{figures.rtt_ms} ms (best {figures.rtt_min_ms}), {figures.throughput_mbs} MB/s "
        f"(protocol {figures.protocol})"
    )
    return figures


async def _not_measured(ctx, node, why: str) -> tuple[None, None]:
    await ctx.log(
        f"link not measured: {node.name} does not allow RPC tunnels, and a direct measurement needs the "
        f"firewall rule a deployment would use, which cannot be set here: {why}. The RPC port stays closed "
        "to the network (the devices were measured on 127.0.0.1). Allow RPC tunnels on the node, or let its "
        "SSH user run the rule's iptables commands (README: Who reaches the rpc-servers), to measure it."
    )
    return None, None


def _coordinators(node) -> list[Node]:
    """Nodes that may coordinate a deployment with `node` as a worker, reached over SSH (the console's own
    host coordinates with the console's figure)."""
    others = (
        Node.objects.filter(enabled=True, may_coordinate=True)
        .exclude(pk=node.pk)
        .select_related("credential")
    )
    # The handshakes are timed by perl, which Windows lacks.
    return [other for other in others if not other.is_local and other.platform != "windows"]


async def from_coordinators(ctx, node) -> dict[str, dict]:
    """The round trip from each coordinator to `node`, timed on the coordinator: {coordinator pk: {
    "coordinator", "rtt_ms"}}. A coordinator that cannot be reached or cannot reach `node` is logged and
    left out (its earlier figure, if any, is dropped with the rest)."""
    figures: dict[str, dict] = {}
    for coordinator in await db(_coordinators)(node):
        try:
            async with transport_for(coordinator) as transport:
                result = await transport.run(handshakes_argv(node.address, node.ssh_port), timeout=90)
        except TransportError as exc:
            await ctx.log(f"link {coordinator.name} → {node.name} not measured: {exc}")
            continue
        reach = parse_handshakes(result.stdout or "\n".join(line.text for line in result.lines))
        if reach.ok and reach.rtt_ms is None:
            await ctx.log(
                f"link {coordinator.name} → {node.name} not measured: perl on {coordinator.name} has no "
                "Time::HiRes to time it (Debian: apt install perl)"
            )
            continue
        if not reach.ok:
            await ctx.log(
                f"link {coordinator.name} → {node.name} not measured: {coordinator.name} cannot connect to "
                f"{node.address}:{node.ssh_port} ({reach.stage}: {reach.reason})"
            )
            continue
        await ctx.log(
            f"link {coordinator.name} → {node.name}: {reach.rtt_ms:g} ms round trip (median of "
            f"{len(reach.pings_ms)} TCP handshakes timed on {coordinator.name})"
        )
        figures[str(coordinator.pk)] = {"coordinator": coordinator.name, "rtt_ms": reach.rtt_ms}
    return figures
