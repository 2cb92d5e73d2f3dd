"""The planner's cluster: devices and nodes as the planner sees them, the settings of a plan, their
validation, and the defaults used where nothing was measured."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planning.unified_memory import (
    DEFAULT_UNIFIED_CLAMP,
    unified_gpu,
    unified_problem,
)

MIB = 1024 * 1024


GIB = 1024 * MIB


MAX_DEVICES = 15  # llama.cpp's -ts takes at most this many entries


# Per generated token llama.cpp's RPC client does about three request/response exchanges with each server it
# computes on (set the input activations, run the graph, read the output activations back), so a remote node
# costs three round-trip times per token on top of its memory-bandwidth time.
RPC_ROUND_TRIPS_PER_TOKEN = 3


DEFAULT_RTT_MS = 1.0


# An uncalibrated node's fixed costs per token: llama-server's own work for one decode pass (sampling, graph
# building, the scheduler) on the coordinator, and what one rpc-server in the chain adds beyond the network
# (its handling of the requests). Typical of what calibration measures on desktop CPUs.
DEFAULT_PASS_OVERHEAD_MS = 1.0


DEFAULT_HOP_MS = 0.5


# What llama.cpp's pipeline parallelism (every layer offloaded to several devices) adds per token beyond the
# devices' own hops: the activations travel through the coordinator between devices, and it waits on events.
DEFAULT_PIPELINE_OVERHEAD_MS = 0.5


# Bytes per element, as (block bytes, block elements) of the ggml type.
KV_TYPES = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}


DEFAULT_BANDWIDTH_GBS = {"cpu": 20.0, "cuda": 300.0, "metal": 100.0, "rocm": 300.0, "vulkan": 100.0}


class ClusterError(ValueError):
    """The cluster description or settings are unusable. The message names the problem."""


@dataclass(frozen=True)
class Device:
    node: str
    name: str  # llama.cpp's name on its node: CUDA0, MTL0, Vulkan0, CPU
    kind: str
    total_bytes: int
    free_bytes: int
    bandwidth_gbs: float
    unified: bool = False
    # macOS's iogpu wired limit of a Metal device when an operator set one (sysctl iogpu.wired_limit_mb);
    # 0 when macOS's own default applies.
    wired_limit_bytes: int = 0
    # Where bandwidth_gbs comes from: "measured", "operator", "table" or "default".
    bandwidth_source: str = "table"
    # A CPU computing inside llama-server itself (when its node coordinates) runs on llama-server's threads,
    # not an rpc-server's: calibration measures that separately.
    local_bandwidth_gbs: float | None = None
    # What llama.cpp itself reports as free, when that differs from free_bytes: its default split follows
    # it. A CPU's is all of the machine's RAM, whatever a container limit or other programs leave.
    reported_free_bytes: int | None = None
    # Its prompt throughput (FLOP/s of prompt processing, in GFLOP/s), measured by calibration; None: the
    # table's figure (planning/first_word.py).
    prompt_gflops: float | None = None


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    devices: tuple[Device, ...]
    coordinator: bool = False
    rpc_port: int = 50052
    rtt_ms: float | None = None
    # Measured by calibration; None: the defaults above.
    pass_overhead_ms: float | None = None
    hop_ms: float | None = None
    pipeline_overhead_ms: float | None = None
    # A CPU quota that binds (below the node's cores; a container's limit, a cgroup), in cores, and the
    # period it is granted per: see `Slot.quota_time`.
    cpu_quota_cores: float | None = None
    cpu_quota_period_ms: float | None = None
    # The coordinator-to-worker link's throughput for large transfers (MB/s), measured by calibration; None:
    # the default (planning/first_word.py).
    link_mbs: float | None = None


@dataclass(frozen=True)
class Settings:
    ctx: int = 4096
    parallel: int = 1
    cache_type: str = "f16"
    clamp: float = DEFAULT_UNIFIED_CLAMP
    ubatch: int = 512
    # Kept free on every device on top of the estimates, as a fraction of its memory limit.
    margin_fraction: float = 0.03

    def validate(self) -> None:
        if self.ctx < 1:
            raise ClusterError("The context size must be at least 1.")
        if self.parallel < 1:
            raise ClusterError("Parallel slots must be at least 1.")
        if self.cache_type not in KV_TYPES:
            raise ClusterError(f"Unknown KV cache type {self.cache_type!r} (use f16, q8_0 or q4_0).")
        if not 0.1 <= self.clamp <= 1.0:
            raise ClusterError("The unified-memory clamp must be between 0.1 and 1.0.")
        if not 0 <= self.margin_fraction < 0.5:
            raise ClusterError("The margin must be between 0 and 0.5.")


def cluster_from_dict(data: dict[str, Any]) -> list[Node]:
    """Nodes from the cluster-file format (see issue 4 / `manage.py plan --help`)."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise ClusterError('The cluster needs a non-empty "nodes" list.')
    nodes = []
    for i, raw in enumerate(data["nodes"]):
        if not isinstance(raw, dict) or not raw.get("name"):
            raise ClusterError(f"Node #{i + 1} needs a name.")
        name = str(raw["name"])
        devices = []
        for j, dev in enumerate(raw.get("devices") or []):
            try:
                total = int(float(dev["total_mib"]) * MIB)
                free = int(float(dev.get("free_mib", dev["total_mib"])) * MIB)
                kind = str(dev.get("kind", "cpu")).lower()
                bandwidth = float(dev.get("bandwidth_gbs") or DEFAULT_BANDWIDTH_GBS.get(kind, 20.0))
                wired = int(float(dev.get("wired_limit_mib") or 0) * MIB)
                local = dev.get("local_bandwidth_gbs")
                prompt = dev.get("prompt_gflops")
                devices.append(
                    Device(
                        node=name,
                        name=str(dev["name"]),
                        kind=kind,
                        total_bytes=total,
                        free_bytes=min(free, total),
                        bandwidth_gbs=bandwidth,
                        unified=bool(dev.get("unified", False)),
                        wired_limit_bytes=wired,
                        bandwidth_source=str(dev.get("bandwidth_source") or "table"),
                        local_bandwidth_gbs=float(local) if local else None,
                        prompt_gflops=float(prompt) if prompt else None,
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ClusterError(f"Node {name!r}, device #{j + 1}: bad or missing {exc}.") from None
            if bandwidth <= 0 or total < 0 or wired < 0:
                raise ClusterError(
                    f"Node {name!r}, device {dev['name']!r}: bandwidth and memory must be positive."
                )
        rtt = raw.get("rtt_ms")
        costs = {
            key: raw.get(key)
            for key in ("pass_overhead_ms", "hop_ms", "pipeline_overhead_ms", "cpu_quota_period_ms")
        }
        for key, value in costs.items():
            if value is not None and (not isinstance(value, int | float) or not 0 <= value < math.inf):
                raise ClusterError(f"Node {name!r}: {key} must be a number of milliseconds, 0 or more.")
        link = raw.get("link_mbs")
        if link is not None and (not isinstance(link, int | float) or not 0 < link < math.inf):
            raise ClusterError(f"Node {name!r}: link_mbs must be a number of MB/s above 0.")
        quota = raw.get("cpu_quota_cores")
        if quota is not None and (not isinstance(quota, int | float) or not 0 < quota < math.inf):
            raise ClusterError(f"Node {name!r}: cpu_quota_cores must be a number of cores above 0.")
        nodes.append(
            Node(
                name=name,
                address=str(raw.get("address") or "127.0.0.1"),
                devices=tuple(devices),
                coordinator=bool(raw.get("coordinator", False)),
                rpc_port=int(raw.get("rpc_port") or 50052),
                rtt_ms=float(rtt) if rtt is not None else None,
                pass_overhead_ms=costs["pass_overhead_ms"],
                hop_ms=costs["hop_ms"],
                pipeline_overhead_ms=costs["pipeline_overhead_ms"],
                cpu_quota_cores=float(quota) if quota is not None else None,
                cpu_quota_period_ms=costs["cpu_quota_period_ms"],
                link_mbs=link,
            )
        )
    validate_cluster(nodes)
    return nodes


def offload_devices(node: Node) -> list[Device]:
    """The devices llama.cpp can list in --device: everything but the coordinator's CPU."""
    return [d for d in node.devices if not (node.coordinator and d.name == "CPU")]


def validate_cluster(nodes: Sequence[Node]) -> None:
    coordinators = [n for n in nodes if n.coordinator]
    if len(coordinators) != 1:
        raise ClusterError(f"Exactly one node must be the coordinator (found {len(coordinators)}).")
    coordinator = coordinators[0]
    if not any(d.name == "CPU" for d in coordinator.devices) and unified_gpu(coordinator) is None:
        raise ClusterError(
            f"The coordinator {coordinator.name!r} needs a CPU device (its RAM) or a unified-memory device "
            "(a Mac's MTL0), whose memory its CPU shares."
        )
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ClusterError("Node names must be unique.")
    for node in nodes:
        dev_names = [d.name for d in node.devices]
        if len(set(dev_names)) != len(dev_names):
            raise ClusterError(f"Node {node.name!r} lists a device twice.")
        problem = unified_problem(node)
        if problem:
            raise ClusterError(problem)
    offload = sum(len(offload_devices(n)) for n in nodes)
    if offload > MAX_DEVICES:
        raise ClusterError(
            f"{offload} devices besides the coordinator's CPU; llama.cpp allows at most {MAX_DEVICES}."
        )
