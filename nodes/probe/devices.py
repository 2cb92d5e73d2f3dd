"""A device as the probe reports it, named as llama.cpp names it (no Django)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeviceInfo:
    name: str  # As llama.cpp names it: CUDA0, ROCm0, MTL0, CPU.
    kind: str  # cpu | cuda | rocm | metal | vulkan (nodes.models.DeviceKind values)
    description: str
    total_bytes: int
    free_bytes: int
    unified_memory: bool = False
    bandwidth_gbs: float | None = None
    # Apple Silicon: the iogpu wired limit an operator set (what Metal may wire at most); None: macOS's own
    # default applies. The planner takes the usable share from it and the clamp (memory_model.py).
    wired_limit_bytes: int | None = None
