"""Whether each node's llama.cpp build offers the devices a plan places on it.

A build's rpc-server lists the devices it serves in its banner (recorded on the Build, builds/job.py); a plan
that puts layers on a device the build lacks (a CPU-only build on a node whose probe found a GPU) would fail
at launch, when the rpc-server or llama-server does not know the device. The plan page, Confirm and Deploy
refuse it before anything starts, naming the node, the device and the build to make.
"""

from __future__ import annotations

from nodes.models import Node

# The build a device needs, by its kind (nodes.models.DeviceKind), as the builds form names it.
BACKEND_LABELS = {"cuda": "CUDA", "rocm": "ROCm (AMD)", "vulkan": "Vulkan", "metal": "Metal", "cpu": "CPU"}


def missing_device(node_name: str, device: str, kind: str, build) -> str:
    """The refusal for one device: which node, which device, which build it has and which to make."""
    backend = BACKEND_LABELS.get(kind, kind)
    offered = ", ".join(sorted(build.offered_devices() or [])) or "no device"
    return (
        f"{node_name}'s llama.cpp build #{build.pk} ({build.backend}) does not offer {device}: its "
        f"rpc-server lists {offered}. Build llama.cpp with the {backend} backend on {node_name} (its Builds "
        "page), then plan again."
    )


def plan_device_refusal(plan: dict) -> str:
    """Why the plan names a device its node's build does not offer, or "" (also when a node has no build,
    which Deploy refuses on its own, or a build whose banner listed no devices)."""
    placements = plan.get("placements") or []
    nodes = {n.name: n for n in Node.objects.filter(name__in={p.get("node") for p in placements})}
    builds = {}
    for placement in placements:
        node = nodes.get(placement.get("node"))
        device = placement.get("device") or ""
        if node is None or device == "CPU":
            continue
        if node.name not in builds:
            builds[node.name] = node.current_build
        build = builds[node.name]
        offered = build.offered_devices() if build is not None else None
        if offered is not None and device not in offered:
            return missing_device(node.name, device, placement.get("kind", ""), build)
    return ""
