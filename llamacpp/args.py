"""llama.cpp's command lines, as pure functions: the binaries' names, and the arguments of llama-server
and ggml-rpc-server for a plan."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

RPC_SERVER_BINARIES = ("ggml-rpc-server", "rpc-server")  # renamed upstream around mid-2026


LLAMA_SERVER_BINARY = "llama-server"


BINARIES = (*RPC_SERVER_BINARIES, LLAMA_SERVER_BINARY)


# llama.cpp's default physical batch (-ub), which the console passes only when a plan asks for another.
DEFAULT_UBATCH = 512


def layer_assignment(splits: list[float], n_layer: int, n_gpu_layers: int) -> list[int]:
    """Device index of each of the n_layer + 1 slots (blocks, then the output layer); -1 means the CPU.

    A faithful copy of llama_model_base::load_tensors: cumulative split fractions in float32, the first
    n_layer + 1 - ngl slots on the CPU, slot r of the offloaded ones on the first device whose cumulative
    fraction exceeds r / ngl.
    """
    n_dev = len(splits)
    cumulative = []
    total = np.float32(0.0)
    for share in splits:
        total = np.float32(total + np.float32(share))
        cumulative.append(total)
    fractions = [float(np.float32(c / total)) for c in cumulative] if total > 0 else [1.0] * n_dev
    start = max(n_layer + 1 - n_gpu_layers, 0)
    active = 0 if n_dev == 0 else min(n_gpu_layers, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= active:
            out.append(-1)
            continue
        value = float(np.float32(np.float32(il - start) / np.float32(active)))
        out.append(min(bisect.bisect_right(fractions, value), n_dev - 1))
    return out


def llama_server_args(placements: list[dict[str, Any]], settings: dict[str, Any], n_layer: int) -> list[str]:
    """Arguments to append after `-m MODEL` for a plan's placements (coordinator CPU first, then devices).

    `-ts` holds whole slot counts per listed device (the output layer counts as one slot of the last device),
    `-ngl` their sum, so llama.cpp places exactly the planned blocks. `--fit off` and an explicit `-c` stop
    llama.cpp from rewriting the plan. When the plan places a mixture of experts' routed experts
    (`expert_blocks`), one `-ot` rule per device holding some puts them there; a device that holds only
    experts is listed with a share of 0, so llama.cpp starts a backend for it and gives it no layer.
    """
    devices = [p for p in placements if p["llama_device"] != "CPU"]
    endpoints: list[str] = []
    for p in devices:
        if p["endpoint"] and p["endpoint"] not in endpoints:
            endpoints.append(p["endpoint"])
    shares = [p["layers"] + (1 if p["output_layer"] else 0) for p in devices]
    args: list[str] = []
    if endpoints:
        args += ["--rpc", ",".join(endpoints)]
    args += ["--device", ",".join(p["llama_device"] for p in devices) if devices else "none"]
    args += ["-ngl", str(sum(shares))]
    if devices:
        args += ["-ts", ",".join(str(s) for s in shares)]
    args += ["-sm", "layer", "-c", str(settings["ctx"]), "-np", str(settings["parallel"])]
    args += ["-ctk", settings["cache_type"], "-ctv", settings["cache_type"], "--fit", "off"]
    for p in placements:
        if p.get("expert_blocks"):
            args += ["-ot", expert_override(p["expert_blocks"], buffer_type(p))]
    if int(settings.get("ubatch", DEFAULT_UBATCH)) != DEFAULT_UBATCH:
        # The compute buffers were planned for this physical batch (planning/costs.py).
        args += ["-ub", str(settings["ubatch"])]
    return args


# llama.cpp's pattern for a block's routed experts (LLM_FFN_EXPS_REGEX in common/common.h, what --n-cpu-moe
# moves; llamacpp/gguf.py counts the same tensors).
EXPERTS_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def buffer_type(placement: dict[str, Any]) -> str:
    """The name of a placement's buffer type, as `-ot` takes it: `CPU`, a local device's own name (`CUDA0`,
    `Vulkan0`), or an RPC device's `RPC<index on its server>[<host:port>]` (ggml-rpc.cpp's
    ggml_backend_rpc_buffer_type), which exists once `--rpc` has added the server: `--rpc` comes first."""
    if placement.get("endpoint"):
        return f"RPC{placement.get('server_device_index', 0)}[{placement['endpoint']}]"
    return placement["llama_device"]


def block_ranges(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as runs (first, last): [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    runs: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][1] == b - 1:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b, b))
    return runs


def expert_override(blocks: list[int], buffer: str) -> str:
    r"""An `-ot` rule putting the routed experts of `blocks` in `buffer`: `blk\.(10|11|12)\.ffn_…_exps=CPU`.

    The block numbers are listed one by one between `blk\.` and `\.`, so 1 never matches 10; the rule holds
    no comma, which llama.cpp would take for the next rule."""
    numbers = "|".join(str(b) for b in sorted(blocks))
    return rf"blk\.({numbers}){EXPERTS_PATTERN}={buffer}"


def rpc_server_args(host: str, port: int, devices: list[str], *, threads: int | None = None) -> list[str]:
    """Arguments for ggml-rpc-server. Devices are always named (`-d MTL0` keeps Apple machines on Metal)."""
    args = ["-H", host, "-p", str(port)]
    if devices:
        args += ["-d", ",".join(devices)]
    if threads:
        args += ["-t", str(threads)]
    return args


def model_alias(name: str) -> str:
    """The `--alias` for a model the console calls `name`. llama-server splits the option at commas (several
    aliases; the API answers with the first in sort order), so a name stays one alias."""
    alias = " ".join(name.replace(",", " ").split())
    return alias or "model"
