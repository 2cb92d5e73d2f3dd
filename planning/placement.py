"""Did llama.cpp do what the plan said? Pure comparisons of a plan with what llama.cpp printed.

The parsing itself is llamacpp/logs.py's (`parse_load_log`, `parse_rpc_banner`); this module only
compares, and words the differences so an operator can act on them. No Django imports.
"""

from __future__ import annotations

from typing import Any

from llamacpp.args import block_ranges
from llamacpp.logs import parse_load_log, parse_rpc_banner, placement_key

MIB = 1024 * 1024
# The proof tests of the planner hold llama.cpp to 2% (or 0.1 MiB for tiny buffers); the same here.
RELATIVE_TOLERANCE = 0.02
ABSOLUTE_TOLERANCE = int(0.1 * MIB)


def _mib(value: int | float) -> str:
    return f"{value / MIB:.2f} MiB"


def blocks_text(blocks: list[int]) -> str:
    """Block numbers in runs, for people: [10, 11, 12, 13, 20] -> "10–13, 20"."""
    return ", ".join(f"{a}–{b}" if b > a else str(a) for a, b in block_ranges(blocks))


def _experts_note(item: dict[str, Any]) -> str:
    blocks = item.get("expert_blocks") or []
    return f" (with the experts of blocks {blocks_text(blocks)})" if blocks else ""


def within(planned: int, logged: int) -> bool:
    return abs(planned - logged) <= max(RELATIVE_TOLERANCE * planned, ABSOLUTE_TOLERANCE)


def expected_offload(plan: dict[str, Any]) -> int | None:
    args = plan.get("llama_server_args") or []
    for i, arg in enumerate(args[:-1]):
        if arg in ("-ngl", "--n-gpu-layers", "--gpu-layers"):
            try:
                return int(args[i + 1])
            except ValueError:
                return None
    return None


def compare(plan: dict[str, Any], log_text: str) -> dict[str, Any]:
    """Per device: planned vs logged weights and KV bytes. No `problems`: llama.cpp followed the plan.

    Every device is held to the plan, the coordinator's CPU too: its weights are what llama.cpp maps from
    the file (planning/costs.py `cpu_weight_tables`). Its logits buffer ("CPU output buffer") is part of
    the compute estimate, which is reported beside what llama.cpp reserved but not held to it (a CPU worker
    under pipeline parallelism is planned at what it writes, not at the reservation).

    A mixture of experts whose experts the plan put apart from their blocks (`expert_blocks`, `-ot` rules)
    is held to the same sizes: a device's planned weights count the experts it holds, not those of its own
    blocks, so a device that holds only experts is checked like any other, and a difference says whose
    experts it was to hold (the rules were not applied when every device shows its blocks' own bytes).
    """
    logged = parse_load_log(log_text.splitlines())
    devices: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    lines: list[str] = []
    planned_keys = set()
    for item in plan.get("placements", []):
        key = placement_key(item)
        planned_keys.add(key)
        got = logged["devices"].get(key, {})
        row = {
            "node": item.get("node"),
            "device": item.get("llama_device"),
            "layers": item.get("layers", 0),
            "planned_weights": int(item.get("weights_bytes") or 0),
            "planned_kv": int(item.get("kv_bytes") or 0),
            "logged_weights": int(got.get("model", 0)),
            "logged_kv": int(got.get("kv", 0)),
            "planned_compute": int(item.get("compute_bytes") or 0),
            "logged_compute": int(got.get("compute", 0) + got.get("output", 0)),
            # The CPU's weights are held to the mapped file range the plan models, unless llama.cpp
            # repacked some into buffers of its own (Q4_0 and others on AVX2, AMX, Arm): it sizes those.
            "checked": not got.get("repacked"),
            "expert_blocks": list(item.get("expert_blocks") or []),
        }
        row["ok"] = not row["checked"] or (
            within(row["planned_weights"], row["logged_weights"])
            and within(row["planned_kv"], row["logged_kv"])
        )
        devices[key] = row
        lines.append(
            f"{key} ({row['node']}): weights {_mib(row['logged_weights'])} "
            f"vs planned {_mib(row['planned_weights'])}, "
            f"KV {_mib(row['logged_kv'])} vs planned {_mib(row['planned_kv'])}, "
            f"compute {_mib(row['logged_compute'])} vs planned {_mib(row['planned_compute'])}"
            + _experts_note(item)
            + ("" if row["checked"] else f" (llama.cpp repacked {_mib(got['repacked'])} of it: not compared)")
            + ("" if row["ok"] else "  <-- differs")
        )
        if not row["ok"]:
            problems.append(
                f"{key} on {row['node']} got weights {_mib(row['logged_weights'])} "
                f"and KV {_mib(row['logged_kv'])}, "
                f"planned {_mib(row['planned_weights'])} and {_mib(row['planned_kv'])}" + _experts_note(item)
            )
    for key, got in logged["devices"].items():
        if key not in planned_keys and key != "CPU" and got.get("model", 0) > 0:
            problems.append(f"{key} got {_mib(got['model'])} of weights the plan did not put there")
    rpc_planned = [k for k, r in devices.items() if ":" in k and r["planned_weights"] > 0]
    rpc_logged = [k for k, got in logged["devices"].items() if ":" in k and got.get("model", 0) > 0]
    if rpc_planned and not rpc_logged:
        if any(devices[k]["layers"] for k in rpc_planned):
            problems.insert(0, "no RPC device received any weights: every layer stayed on the coordinator")
        else:
            problems.insert(
                0,
                "no RPC device received any weights: the experts planned there stayed on the coordinator "
                "(were the -ot rules applied?)",
            )
    wanted = expected_offload(plan)
    if logged["offloaded"] is not None and wanted is not None and logged["offloaded"][0] != wanted:
        problems.append(f"llama.cpp offloaded {logged['offloaded'][0]} layers, the plan asked for {wanted}")
    if logged["offloaded"] is None and not logged["devices"]:
        problems.append("llama-server's log holds no buffer sizes (was it started with -lv 4?)")
    return {"devices": devices, "offloaded": logged["offloaded"], "problems": problems, "lines": lines}


def banner_shortfalls(banner_text: str, needs: dict[str, int]) -> list[str]:
    """Devices whose free memory (as the rpc-server reports it) is below what the plan puts on them."""
    banner = parse_rpc_banner(banner_text)
    reported = {d["name"]: d for d in banner["devices"]}
    problems = []
    for name, needed in needs.items():
        device = reported.get(name)
        if device is None:
            listed = ", ".join(reported) or "none"
            problems.append(f"the rpc-server does not offer device {name} (it offers {listed})")
            continue
        free = device["free_mib"] * MIB
        if free < needed:
            problems.append(f"{name} has {_mib(free)} free, the plan needs {_mib(needed)}")
    return problems
