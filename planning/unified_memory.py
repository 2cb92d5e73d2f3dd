"""Unified memory (Apple Silicon): how much of it a plan may use, and the one pool a Mac's CPU and GPU share.

Pure Python, no Django; planning/costs.py applies it. The probe reports a Mac's raw memory and the
wired limit an operator set (`sysctl iogpu.wired_limit_mb`); the clamp is applied here and only here:

    what the GPU (MTL0) may use   = min(free, wired limit if one is set, clamp x total)
    what the Mac gives llama.cpp  = min(free, clamp x total), its CPU's buffers and its GPU's together

The wired limit caps what Metal may wire, not what the CPU's buffers take, so it bounds the GPU alone. On a
coordinator the CPU (the input embedding, CPU-resident blocks, its compute buffer) and the GPU draw on that
one pool; a Mac described by its MTL0 alone gets its CPU from it (`cpu_of_unified`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The share of unified memory a plan may use when nobody says otherwise (RAMDECK_UNIFIED_MEMORY_CLAMP and the
# plan form start from it). macOS lets Metal wire roughly 67-84% of memory by default, depending on the
# machine; 70% leaves the system and its other programs room on every Apple Silicon Mac we know of.
DEFAULT_UNIFIED_CLAMP = 0.70
# The CPU cores of an Apple chip reach about half of its memory bandwidth (the GPU reaches all of it), so a
# coordinator described by its unified device alone gets a CPU at half that device's speed.
UNIFIED_CPU_BANDWIDTH_SHARE = 0.5


def unified_gpu(node: Any) -> Any | None:
    """The node's unified-memory GPU (Apple's MTL0), if it has one."""
    return next((d for d in node.devices if d.unified and d.name != "CPU"), None)


def unified_problem(node: Any) -> str | None:
    """What is wrong with a node's unified memory as described, if anything: one memory granted twice."""
    unified = [d.name for d in node.devices if d.unified and d.name != "CPU"]
    if len(unified) > 1:
        return (
            f"Node {node.name!r} lists several unified-memory devices ({', '.join(unified)}); they share one "
            "memory, so list one."
        )
    if unified and not node.coordinator and any(d.name == "CPU" for d in node.devices):
        return (
            f"Worker {node.name!r} lists a CPU device beside its unified-memory device {unified[0]}: they "
            f"are the same memory. List only {unified[0]} (ggml-rpc-server on a Mac serves MTL0)."
        )
    return None


def unified_share(device: Any, clamp: float) -> tuple[int, str]:
    """(bytes, basis): what a unified-memory GPU may use before its free memory counts, and what sets it:
    "clamp" (clamp x total) or "wired_limit" (a lower wired limit). The plan page says which."""
    clamped = int(clamp * device.total_bytes)
    if 0 < device.wired_limit_bytes < clamped:
        return device.wired_limit_bytes, "wired_limit"
    return clamped, "clamp"


def limit_basis(device: Any, clamp: float) -> str:
    """What limits a device: "free" memory, or for unified memory the "clamp" or the "wired_limit"."""
    if not device.unified:
        return "free"
    share, basis = unified_share(device, clamp)
    return basis if share <= device.free_bytes else "free"


def pool_limit_bytes(device: Any, clamp: float) -> int:
    """All a unified-memory node may give llama.cpp, its CPU and GPU together: min(free, clamp x total)."""
    return max(0, min(device.free_bytes, int(clamp * device.total_bytes)))


def cpu_of_unified(device: Any) -> Any:
    """The CPU of a coordinator described by its unified-memory device alone: the same memory (so the same
    pool), at the share of the bandwidth a CPU reaches, and no wired limit (that binds the GPU only)."""
    return dataclasses.replace(
        device,
        name="CPU",
        kind="cpu",
        bandwidth_gbs=device.bandwidth_gbs * UNIFIED_CPU_BANDWIDTH_SHARE,
        wired_limit_bytes=0,
    )
