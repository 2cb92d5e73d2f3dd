"""Nodes and devices as the planner sees them: the pool of nodes with fresh hardware, and each node's
figures (measured where calibrated, the table's otherwise) turned into planning.cluster rows."""

from __future__ import annotations

from django.conf import settings

from nodes.models import Node
from planning import planner

MIB = 1024**2


def planner_device(node: Node, d, build=None, *, coordinator: bool = False) -> planner.Device:
    source = d.bandwidth_source
    # ggml-rpc-server reports all of the machine's RAM for a CPU, whatever limit the probe found: llama.cpp's
    # own default split follows that.
    physical = (node.facts or {}).get("ram_physical_bytes") if d.kind == "cpu" else None
    total, free = d.total_bytes, min(d.free_bytes, d.total_bytes)
    banner = build.banner_device(d.name) if build is not None and not total else None
    if banner:
        # A GPU whose memory the probe could not read (a Vulkan card without amdgpu's sysfs files): what the
        # build's own rpc-server said at registration.
        total, free = banner["total_mib"] * MIB, min(banner["free_mib"], banner["total_mib"]) * MIB
    heap = build.banner_device(d.name) if build is not None and d.unified_memory and not coordinator else None
    if d.kind == "vulkan" and heap and heap["total_mib"] * MIB < total:
        # A Vulkan device that shares the system's RAM (an integrated GPU, Mesa's llvmpipe) was probed as all
        # of it; its driver may offer less (llvmpipe: 2048 MiB), and a worker's rpc-server serves only this
        # device, so what the driver offers is what it can hold. (On a coordinator the CPU's share of the
        # RAM is llama-server's own, outside the driver's heap.)
        total, free = heap["total_mib"] * MIB, min(free, heap["total_mib"] * MIB)
    return planner.Device(
        node=node.name,
        name=d.name,
        kind=d.kind,
        total_bytes=total,
        free_bytes=free,
        bandwidth_gbs=d.effective_bandwidth_gbs or planner.DEFAULT_BANDWIDTH_GBS.get(d.kind, 20.0),
        unified=d.unified_memory,
        wired_limit_bytes=d.wired_limit_bytes or 0,
        bandwidth_source="default" if source == "unknown" else source,
        # Blocks on a coordinator's own CPU run inside llama-server: its measured figure there, unless an
        # admin set the device's figure by hand.
        local_bandwidth_gbs=d.measured_local_bandwidth_gbs if source == "measured" else None,
        reported_free_bytes=physical if physical and physical != d.free_bytes else None,
        prompt_gflops=d.measured_prompt_gflops if source == "measured" else None,
    )


def planner_nodes(nodes: list[Node], coordinator: Node) -> list[planner.Node]:
    """The planner's view of Node and Device rows: the coordinator first; remote nodes by RPC address.

    Calibrated figures are used where they are (bandwidths per device; the node's pass and hop costs and
    its round trip to the RPC port, from the coordinator itself where it measured one), unless the probe has
    found other hardware since."""
    out = []
    for node in [coordinator, *[n for n in nodes if n.pk != coordinator.pk]]:
        rows = list(node.devices.all())
        build = node.current_build
        calibrated = node.calibrated_at is not None and not any(
            d.measurement_state == "hardware_changed" for d in rows
        )
        rtt = node.link_rtt_ms if calibrated and node.link_rtt_ms is not None else node.rtt_ms
        # Measured from the console, which is the coordinator only when it runs on the console's own host;
        # any other coordinator's own figure for this pair, when it measured one, is what llama-server pays.
        pair = (
            node.link_rtt_from(coordinator)
            if node.pk != coordinator.pk and not coordinator.is_local
            else None
        )
        rtt = pair if pair is not None else rtt
        out.append(
            planner.Node(
                name=node.name,
                address=node.rpc_endpoint_host,
                devices=tuple(
                    planner_device(node, d, build, coordinator=node.pk == coordinator.pk) for d in rows
                ),
                coordinator=node.pk == coordinator.pk,
                rpc_port=node.rpc_port,
                rtt_ms=rtt,
                pass_overhead_ms=node.pass_overhead_ms if calibrated else None,
                hop_ms=node.rpc_hop_ms if calibrated else None,
                pipeline_overhead_ms=node.pipeline_overhead_ms if calibrated else None,
                # Measured from the console: the pair's own figure when the console's host coordinates; for
                # another coordinator the best figure there is (the round trip is its own, above).
                link_mbs=node.link_throughput_mbs if calibrated else None,
                **binding_cpu_quota(node.facts or {}),
            )
        )
    return out


def binding_cpu_quota(facts: dict) -> dict[str, float]:
    """The node's CPU quota and its period as the planner takes them, when the quota binds (below its
    cores: a larger one never holds the node back)."""
    quota, period = facts.get("cpu_quota_cores"), facts.get("cpu_quota_period_ms")
    if not quota or not period or quota >= (facts.get("cpu_cores") or float("inf")):
        return {}
    return {"cpu_quota_cores": float(quota), "cpu_quota_period_ms": float(period)}


def stale_calibration_warnings(nodes: list[Node]) -> list[str]:
    """Plan warnings for figures the planner uses although they are old."""
    old = sorted(f"{n.name}/{d.name}" for n in nodes for d in n.devices.all() if d.measurement_state == "old")
    if not old:
        return []
    return [
        f"The calibration of {', '.join(old)} is older than "
        f"{settings.RAMDECK_CALIBRATION_MAX_AGE_DAYS:g} days: calibrate again for a prediction you can trust."
    ]


def tunnel_warnings(plan: dict, nodes: list[Node]) -> list[str]:
    """Plan warnings for the workers the plan places layers on that no SSH tunnel can reach (a Windows PC:
    Node.tunnel_refusal says why), so the plan page says before a confirm that they are reached directly."""
    placed = {p.get("node") for p in plan.get("placements", []) if p.get("endpoint")}
    return [
        f"RPC to {n.name} goes directly over the LAN, never through an SSH tunnel: {n.tunnel_refusal}"
        for n in nodes
        if n.name in placed and n.platform == "windows" and n.tunnel_refusal
    ]


def pool_nodes() -> list[Node]:
    """Enabled nodes with fresh hardware data: the default pool."""
    nodes = Node.objects.filter(enabled=True).prefetch_related("devices")
    return [n for n in nodes if n.hardware_is_fresh and n.devices.exists()]
