"""The clamped waterfill planner: which devices run which blocks of a model, and how fast that will be.

Pure Python (numpy for the dynamic programme), no Django. Input: a model profile
(llamacpp/gguf.py), a cluster (nodes with devices, one coordinator) and settings. Output: a
JSON-able plan (see `plan`). The model of a split lives in planning/costs.py, the search in
planning/waterfill.py; this module assembles the plan, the baseline and the suggestions.

The model of memory (per device, llama.cpp's own accounting, checked against real logs in
tests/planning/test_planner_vs_llamacpp.py):
    weights of its blocks + KV cache of its blocks + compute buffer estimate (+ the output layer on the last
    device; + the input embedding on the coordinator's CPU) <= capacity,
    capacity = min(free, total) minus a margin; for a unified-memory device (Apple's MTL0)
               min(free, wired limit if one is set, clamp x total) minus a margin; on a coordinator
               with unified memory its CPU and that device also share one pool, min(free, clamp x total).

The model of speed (single-stream decode is memory-bandwidth bound):
    seconds per token = the coordinator's fixed cost of a pass
                        + sum over devices of (weight bytes + KV bytes it holds) / its bandwidth
                        + for every remote node in use: its hop cost + RPC_ROUND_TRIPS_PER_TOKEN x its RTT,
with the figures the calibrate job measured where there are some (planning/costs.py).

The search: llama.cpp keeps the first blocks on the coordinator's CPU and gives the rest to the listed devices
as contiguous slices, the output layer with the last one. For each choice of last device, the other devices
are put in a canonical order (nodes by their fastest device, devices by bandwidth) and a dynamic programme
over "blocks placed so far" picks the exact block count of every device (0 = leave it out) minimising
predicted time under the memory limits. When all blocks have the same size (as in real models, up to
quantisation mixes), device order only matters through which device is last, so the result is optimal
over every order and split; tests prove it against exhaustive search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from llamacpp.args import layer_assignment, llama_server_args, rpc_server_args
from planning.cluster import (
    DEFAULT_BANDWIDTH_GBS,
    DEFAULT_HOP_MS,
    DEFAULT_PASS_OVERHEAD_MS,
    DEFAULT_PIPELINE_OVERHEAD_MS,
    DEFAULT_RTT_MS,
    GIB,
    KV_TYPES,
    MAX_DEVICES,
    MIB,
    RPC_ROUND_TRIPS_PER_TOKEN,
    ClusterError,
    Device,
    Node,
    Settings,
    cluster_from_dict,
    offload_devices,
    validate_cluster,
)
from planning.costs import (
    EXPERTS_ON_CPU,
    PIPELINE_COPIES,
    Evaluation,
    Problem,
    Slot,
    Split,
    build_problem,
    capacity_bytes,
    compute_bytes,
    evaluate,
    input_copy_bytes,
    kv_bytes_per_block,
    kv_cells,
    pipeline_parallel,
)
from planning.experts import places_experts, search_experts
from planning.first_word import (
    BETTER_BY,
    DECODE_TIE,
    first_word,
    predict_ttft,
    prompt_problem,
    prompt_rate,
    prompt_tokens,
)
from planning.unified_memory import limit_basis
from planning.waterfill import INF
from planning.waterfill import search as search_layers

__all__ = [
    "EXPERTS_ON_CPU",
    "DEFAULT_BANDWIDTH_GBS",
    "DEFAULT_HOP_MS",
    "DEFAULT_PASS_OVERHEAD_MS",
    "DEFAULT_PIPELINE_OVERHEAD_MS",
    "DEFAULT_RTT_MS",
    "GIB",
    "KV_TYPES",
    "MAX_DEVICES",
    "MIB",
    "PIPELINE_COPIES",
    "RPC_ROUND_TRIPS_PER_TOKEN",
    "ClusterError",
    "Device",
    "Evaluation",
    "Node",
    "Problem",
    "Settings",
    "Slot",
    "Split",
    "baseline_split",
    "build_problem",
    "capacity_bytes",
    "cluster_from_dict",
    "compute_bytes",
    "evaluate",
    "extra_device_bytes",
    "input_copy_bytes",
    "kv_bytes_per_block",
    "kv_cells",
    "pipeline_parallel",
    "plan",
    "quick_fit",
    "search",
    "suggestions",
    "validate_cluster",
]


# ---------------------------------------------------------------------------------------------------------
# The search


def search(problem: Problem) -> tuple[Split | None, float]:
    """The best split under the model, or (None, inf) when nothing fits: the layers' search
    (planning/waterfill.py), and for a mixture of experts the search that may place experts apart from their
    blocks (planning/experts.py) when that is faster."""
    split, seconds = search_layers(problem)
    if places_experts(problem):
        apart, apart_seconds = search_experts(problem)
        if apart is not None and (split is None or apart_seconds < seconds * (1 - 1e-12)):
            return apart, apart_seconds
    return split, seconds


# ---------------------------------------------------------------------------------------------------------
# The llama.cpp default split (the baseline)


def default_split_devices(problem: Problem) -> list[int]:
    """llama.cpp's devices without --device: each server's GPUs (else its CPU), RPC first, then local GPUs."""
    chosen = []
    for node in problem.nodes:
        if node.coordinator:
            continue
        idx = [i for i, s in enumerate(problem.slots) if s.node is node]
        gpus = [i for i in idx if problem.slots[i].device.kind != "cpu"]
        chosen += gpus or [i for i in idx if problem.slots[i].device.kind == "cpu"]
    chosen += [i for i, s in enumerate(problem.slots) if not s.remote]
    return chosen


def reported_free(slot: Slot) -> int:
    """The free memory llama.cpp sees on a device. Metal reports its working-set limit, which is the wired
    limit when one is set and otherwise close to the clamped share the planner allows; a CPU reports all of
    the machine's RAM, whatever a container limit or other programs leave (`reported_free_bytes`)."""
    if slot.device.unified:
        return slot.limit
    return slot.device.reported_free_bytes or slot.device.free_bytes


def baseline_split(problem: Problem) -> Split:
    """llama.cpp's split proportional to the free memory its devices report, with every layer offloaded."""
    devices = default_split_devices(problem)
    return proportional_split(problem, devices, [reported_free(problem.slots[i]) for i in devices])


def proportional_split(problem: Problem, devices: list[int], weights: list[float]) -> Split:
    """Every layer offloaded to `devices` (slot indices, in order) in proportion to `weights`, as llama.cpp
    splits for -ts."""
    n = len(problem.block_bytes)
    if not devices:
        return Split(n, [], [])
    shares = layer_assignment(weights, n, n + 1)
    counts = [0] * len(devices)
    for dev in shares[:n]:
        counts[dev] += 1
    last = shares[n]  # the output layer's device
    # Devices with no share after the output device simply stay idle; trim the order at the output device.
    keep = [k for k in range(len(devices)) if counts[k] > 0 or k == last]
    return Split(0, [devices[k] for k in keep], [counts[k] for k in keep])


# ---------------------------------------------------------------------------------------------------------
# Plan assembly


def _llama_names(problem: Problem, split: Split) -> dict[int, tuple[str, str | None, int]]:
    """slot index -> (llama.cpp device name, endpoint or None, index of the device on its rpc-server).

    Remote nodes join --rpc in order of first use and expose only their used devices (in plan order), so
    RPC device names follow llama.cpp's single counter across servers.
    """
    per_node: dict[str, list[int]] = {}
    # Devices that hold only experts are listed after the others (with no share of the layers).
    listed = split.order + expert_hosts(split)
    for i in listed:
        slot = problem.slots[i]
        if slot.remote:
            per_node.setdefault(slot.node.name, []).append(i)
    names: dict[int, tuple[str, str | None, int]] = {}
    counter = 0
    for idx in per_node.values():
        for k, i in enumerate(idx):
            node = problem.slots[i].node
            names[i] = (f"RPC{counter}", f"{node.address}:{node.rpc_port}", k)
            counter += 1
    for i in listed:
        if not problem.slots[i].remote:
            names[i] = (problem.slots[i].device.name, None, 0)
    return names


def expert_hosts(split: Split) -> list[int]:
    """Slots that hold experts and no block, in slot order (as `evaluate` lists them)."""
    if split.experts is None:
        return []
    return sorted({i for i in split.experts if i != EXPERTS_ON_CPU} - set(split.order))


def _placements(problem: Problem, split: Split, evaluation: Evaluation) -> list[dict[str, Any]]:
    names = _llama_names(problem, split)
    out = []
    for part in evaluation.parts:
        slot, first, count, output = part.slot, part.first_block, part.blocks, part.holds_output
        is_cpu = slot is problem.cpu
        if not is_cpu and count == 0 and not output and not part.expert_blocks:
            continue
        llama_device, endpoint, server_index = (
            ("CPU", None, 0) if is_cpu else names[problem.slots.index(slot)]
        )
        read = sum(problem.read_bytes[first : first + count]) + (
            int(problem.profile["output_bytes"]) if output else 0
        )
        if split.experts is not None:
            # Its blocks' experts where they are placed, not where the blocks are.
            own = range(first, first + count)
            read += sum(problem.expert_read[b] for b in part.expert_blocks) - sum(
                problem.expert_read[b] for b in own
            )
        in_pool = problem.pool_slot is not None and (is_cpu or slot is problem.slots[problem.pool_slot])
        out.append(
            {
                "node": slot.node.name,
                "device": slot.device.name,
                "llama_device": llama_device,
                "endpoint": endpoint,
                "server_device_index": server_index,
                "kind": slot.device.kind,
                "layers": count,
                "first_layer": first,
                "output_layer": output,
                # The blocks whose routed experts it holds, when the plan places experts apart (`-ot`).
                "expert_blocks": list(part.expert_blocks),
                "weights_bytes": part.weights,
                "kv_bytes": part.kv,
                "compute_bytes": part.compute,
                "used_bytes": part.used_bytes,
                "capacity_bytes": slot.capacity,
                "limit_bytes": slot.limit,
                "total_bytes": slot.device.total_bytes,
                "free_bytes": slot.device.free_bytes,
                "unified": slot.device.unified,
                # What limits it: "free" memory, the "clamp" or the "wired_limit" on unified memory, or the
                # "pool" it shares with the coordinator's unified GPU (its CPU's share).
                "limit_basis": "pool"
                if in_pool and is_cpu
                else limit_basis(slot.device, problem.settings.clamp),
                "in_unified_pool": in_pool,
                "wired_limit_bytes": slot.device.wired_limit_bytes,
                "bandwidth_gbs": round(slot.bandwidth / 1e9, 3),
                "bandwidth_source": slot.device.bandwidth_source,
                "fits": part.used_bytes <= slot.capacity,
                "ms_per_token": round(1000 * _slot_time(slot, read, bool(count or output)), 4),
            }
        )
    return out


def _slot_time(slot: Slot, read: int, used: bool) -> float:
    """Seconds per token of a placement: its bytes over its bandwidth, with its node's overhead when used."""
    work = read / slot.bandwidth
    return slot.time_with_overhead(work) if used and slot.remote else slot.quota_time(work)


def _rpc_servers(placements: list[dict[str, Any]], problem: Problem) -> list[dict[str, Any]]:
    servers: dict[str, dict[str, Any]] = {}
    for p in placements:
        if not p["endpoint"]:
            continue
        node = next(n for n in problem.nodes if n.name == p["node"])
        entry = servers.setdefault(
            p["node"], {"node": node.name, "address": node.address, "port": node.rpc_port, "devices": []}
        )
        entry["devices"].append(p["device"])
    for entry in servers.values():
        entry["args"] = rpc_server_args(entry["address"], entry["port"], entry["devices"])
    return list(servers.values())


def _tps(seconds: float) -> float | None:
    return round(1.0 / seconds, 3) if seconds > 0 and seconds < INF else None


def unified_pool(problem: Problem, placements: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The coordinator's unified memory shared by its CPU and GPU: what they may use together and use."""
    if problem.pool_slot is None:
        return None
    gpu = problem.slots[problem.pool_slot].device
    used = sum(p["used_bytes"] for p in placements if p["in_unified_pool"])
    return {
        "node": problem.coordinator.name,
        "devices": ["CPU", gpu.name],
        "total_bytes": gpu.total_bytes,
        "limit_bytes": problem.pool_limit,
        "capacity_bytes": problem.pool_capacity,
        "used_bytes": used,
        "fits": used <= problem.pool_capacity,
    }


def _baseline(problem: Problem) -> dict[str, Any]:
    split = baseline_split(problem)
    ev = evaluate(problem, split)
    placements = _placements(problem, split, ev)
    over = [f"{p['node']}/{p['device']}" for p in placements if not p["fits"]]
    pool = unified_pool(problem, placements)
    if pool and not pool["fits"]:
        over.append(f"{pool['node']} (its CPU and {pool['devices'][1]} together)")
    return {
        "fits": ev.fits,
        "placements": placements,
        "predicted_tokens_per_s": _tps(ev.seconds_per_token),
        "over_capacity": over,
        "first_word": first_word(problem, split),
    }


def quick_fit(
    profile: dict[str, Any], nodes: Sequence[Node], settings: Settings
) -> tuple[bool, float | None]:
    """(fits, predicted tokens/s) without the baseline and suggestions: for overviews and searches."""
    split, seconds = search(build_problem(profile, nodes, settings))
    return split is not None, _tps(seconds)


_solve = quick_fit


def _extra_node(nodes: Sequence[Node], capacity: int) -> list[Node]:
    slowest = min((d.bandwidth_gbs for n in nodes for d in n.devices), default=20.0)
    device = Device("another node", "CPU", "cpu", capacity, capacity, slowest)
    return [*nodes, Node("another node", "0.0.0.0", (device,), rpc_port=50052, rtt_ms=DEFAULT_RTT_MS)]


def suggestions(profile: dict[str, Any], nodes: Sequence[Node], settings: Settings) -> list[dict[str, Any]]:
    """Changes that make a plan that does not fit fit, each checked by running the planner with it."""
    out: list[dict[str, Any]] = []

    def add(change: str, value: Any, text: str, new: Settings | None = None, new_nodes=None) -> None:
        ok, tps = _solve(profile, new_nodes or nodes, new or settings)
        out.append(
            {"change": change, "value": value, "text": text, "predicted_tokens_per_s": tps, "fits": ok}
        )

    # A context is suggested up to the one the model was trained for, never past it (however far past it
    # the settings go).
    trained = int(profile.get("context_length") or 0)
    ceiling = min(settings.ctx - 1, trained) if trained else settings.ctx - 1
    if ceiling >= 256:
        lo, hi = 0, ceiling // 256  # largest k with ctx = 256 k fitting, 0 = none
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _solve(profile, nodes, replace(settings, ctx=mid * 256))[0]:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            add("ctx", lo * 256, f"A context of {lo * 256} tokens fits.", replace(settings, ctx=lo * 256))
    order = list(KV_TYPES)
    for cache in order[order.index(settings.cache_type) + 1 :]:
        if _solve(profile, nodes, replace(settings, cache_type=cache))[0]:
            add(
                "cache_type",
                cache,
                f"A {cache} KV cache fits at this context.",
                replace(settings, cache_type=cache),
            )
            break
    if settings.parallel > 1 and _solve(profile, nodes, replace(settings, parallel=1))[0]:
        add("parallel", 1, "One parallel slot instead of several fits.", replace(settings, parallel=1))
    if any(d.unified for n in nodes for d in n.devices):
        for clamp in (0.75, 0.8, 0.85, 0.9):
            if clamp > settings.clamp and _solve(profile, nodes, replace(settings, clamp=clamp))[0]:
                add(
                    "clamp",
                    clamp,
                    f"Letting unified-memory devices use {clamp:.0%} of their memory fits.",
                    replace(settings, clamp=clamp),
                )
                break
    extra = extra_device_bytes(profile, nodes, settings)
    if extra is not None:
        add(
            "add_node",
            extra,
            f"Another node with at least {_size(extra)} free makes it fit.",
            new_nodes=_extra_node(nodes, extra),
        )
    return out


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def extra_device_bytes(profile: dict[str, Any], nodes: Sequence[Node], settings: Settings) -> int | None:
    """The least free memory one more (slowest-class) node would need for the model to fit, to 1%."""
    offload = sum(len(offload_devices(n)) for n in nodes)
    if offload >= MAX_DEVICES:
        return None
    hi = int(
        sum(profile["block_weight_bytes"])
        + sum(kv_bytes_per_block(profile, settings))
        + profile["output_bytes"]
        + PIPELINE_COPIES * compute_bytes(profile, settings, role="out", coordinator_cpu=False)
    )
    hi = int(hi / (1 - settings.margin_fraction)) + MIB
    if not _solve(profile, _extra_node(nodes, hi), settings)[0]:
        return None
    lo = 0
    while hi - lo > max(MIB, hi // 100):
        mid = (lo + hi) // 2
        if _solve(profile, _extra_node(nodes, mid), settings)[0]:
            hi = mid
        else:
            lo = mid
    return -(-hi // MIB) * MIB


def _without_kv(problem: Problem) -> Problem:
    """The problem as a token sees it with nothing in the KV cache: every block's read without its KV."""
    read = [r - k for r, k in zip(problem.read_bytes, problem.kv, strict=True)]
    return replace(problem, read_bytes=read)


def speed_model(problem: Problem, split: Split | None) -> dict[str, Any]:
    """The fixed costs the prediction counts, for the page: the coordinator's pass, each remote node's hop
    (its measured or default hop plus its round trips) and the period of each used node's CPU quota."""
    used = {problem.slots[i].node.name for i in (split.order if split else [])}
    hops = {}
    bursts = {}
    for slot in problem.slots:
        if slot.remote and slot.node.name in used:
            hops[slot.node.name] = round(slot.overhead_s * 1000, 3)
            if slot.burst_s:
                bursts[slot.node.name] = round(slot.burst_s * 1000, 3)
    pipeline = problem.pipeline_s * 1000 if split is not None and pipeline_parallel(split) else 0.0
    return {
        "pass_overhead_ms": round(problem.fixed_s * 1000, 3),
        "hop_ms": hops,
        "pipeline_overhead_ms": round(pipeline, 3),
        # Per node under a CPU quota: what its work per token gains from starting with quota to spend
        # (`Slot.quota_time`), at most.
        "quota_period_ms": bursts,
    }


def _measurement_warnings(nodes: Sequence[Node], problem: Problem) -> list[str]:
    guessed = sorted(
        {f"{d.node}/{d.name}" for n in nodes for d in n.devices if d.bandwidth_source in ("table", "default")}
    )
    out = []
    if guessed:
        out.append(
            "The speed of "
            + ", ".join(guessed)
            + " comes from a table of typical figures, not a measurement: "
            "calibrate those nodes for a prediction you can trust."
        )
    if problem.coordinator.pass_overhead_ms is None:
        out.append(
            f"The coordinator {problem.coordinator.name} is not calibrated: its cost per pass is assumed "
            f"to be {DEFAULT_PASS_OVERHEAD_MS:g} ms."
        )
    return out


def _settings_dict(settings: Settings) -> dict[str, Any]:
    return asdict(settings)


def search_prompt(problem: Problem, n_tokens: int | None = None) -> Split | None:
    """The split with the shortest predicted time to the first token of an `n_tokens` prompt that fits, of
    these: the decode search run on the problem as the prompt sees it (planning/first_word.py), which knows
    no pipelining; and, since pipeline parallelism overlaps the ubatches across devices, every block offloaded
    in proportion to the devices' prompt throughput, and llama.cpp's default split. Each priced exactly."""
    n_tokens = n_tokens or prompt_tokens(problem.settings)
    found, _ = search_layers(prompt_problem(problem, n_tokens))
    devices = default_split_devices(problem)
    candidates = [
        found,
        proportional_split(problem, devices, [prompt_rate(problem.slots[i]) for i in devices]),
        baseline_split(problem),
    ]
    fitting = [c for c in candidates if c is not None and evaluate(problem, c).fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: predict_ttft(problem, c, n_tokens))


def _same(a: Split, b: Split) -> bool:
    return (a.cpu_blocks, a.order, a.counts, a.experts) == (b.cpu_blocks, b.order, b.counts, b.experts)


def _prompt_option(problem: Problem, split: Split) -> dict[str, Any] | None:
    """The split best for long prompts, when it differs from the plan's and reaches the first token at
    least BETTER_BY sooner: its devices, first token, load and decode speed, for the operator to choose."""
    other = search_prompt(problem)
    if other is None or _same(other, split):
        return None
    mine, theirs = predict_ttft(problem, split), predict_ttft(problem, other)
    if theirs > mine * (1 - BETTER_BY):
        return None
    ev = evaluate(problem, other)
    return {
        "placements": _placements(problem, other, ev),
        "predicted_tokens_per_s": _tps(ev.seconds_per_token),
        "first_word": first_word(problem, other),
    }


# What a plan optimises (see `plan`).
OBJECTIVES = ("decode", "fastest", "prompt")


def _first_word_tie(problem: Problem, split: Split, seconds: float) -> Split:
    """The split best for long prompts instead of the fastest to decode, when the two decode alike (within
    DECODE_TIE, and no slower than llama.cpp's default split) and it reaches the first token at least
    BETTER_BY sooner: a household feels the wait for a first word before it feels a few percent of decode.
    Otherwise `split` itself."""
    other = search_prompt(problem)
    if other is None or _same(other, split):
        return split
    theirs = evaluate(problem, other)
    if not theirs.fits or theirs.seconds_per_token > seconds * (1 + DECODE_TIE):
        return split
    default = evaluate(problem, baseline_split(problem))
    if default.fits and theirs.seconds_per_token > default.seconds_per_token:
        return split
    if predict_ttft(problem, other) > predict_ttft(problem, split) * (1 - BETTER_BY):
        return split
    return other


def plan(
    profile: dict[str, Any],
    nodes: Sequence[Node],
    settings: Settings | None = None,
    *,
    objective: str = "decode",
    split: Split | None = None,
    problem: Problem | None = None,
) -> dict[str, Any]:
    """The plan: a JSON-able dict (keys documented in issue 4; extra keys for the preview page).

    `objective`: "decode" (the fastest single-stream decode, or a split that decodes within DECODE_TIE of it
    and reaches the first token of a long prompt much sooner: `_first_word_tie`), "fastest" (the fastest
    decode, whatever its first token) or "prompt" (the shortest time to the first token of a PROMPT_TOKENS
    prompt, planning/first_word.py).

    With `split`, the plan of that split, placed by hand (planning/manual.py), instead of the search's: the
    same placements, arguments and baseline, `placed_by_hand` set and the search's own prediction beside it
    (`planner_tokens_per_s`). `problem`: the one built already for these inputs, to save building it again."""
    if objective not in OBJECTIVES:
        raise ClusterError(f"Unknown objective {objective!r} (use {', '.join(OBJECTIVES)}).")
    settings = settings or Settings()
    problem = problem or build_problem(profile, nodes, settings)
    by_hand = split is not None
    searched, seconds = search(problem)
    decode_split = searched
    if split is None:
        split = searched
        if objective == "prompt" and split is not None:
            split = search_prompt(problem) or split
            seconds = evaluate(problem, split).seconds_per_token
        elif objective == "decode" and split is not None:
            split = _first_word_tie(problem, split, seconds)
            seconds = evaluate(problem, split).seconds_per_token
    else:
        planner_seconds = seconds
        seconds = evaluate(problem, split).seconds_per_token
    warnings = list(problem.warnings) + _measurement_warnings(nodes, problem)
    n_layer = int(profile["block_count"])
    trained = int(profile.get("context_length") or 0)
    if trained and settings.ctx > trained:
        warnings.append(f"The context ({settings.ctx}) is longer than the model was trained for ({trained}).")
    if settings.cache_type != "f16":
        warnings.append(
            "A quantised V cache needs flash attention; llama.cpp enables it where the device supports it."
        )
    result: dict[str, Any] = {
        "fits": split is not None,
        "n_layer": n_layer,
        "model": {
            "name": profile.get("name", ""),
            "architecture": profile.get("architecture"),
            "weights_total_bytes": profile.get("weights_total_bytes"),
        },
        "settings": _settings_dict(settings),
        "coordinator": problem.coordinator.name,
        "placements": [],
        "predicted_tokens_per_s": None,
        "pipeline_parallel": False,
        "llama_server_args": [],
        "rpc_servers": [],
        "warnings": warnings,
        "suggestions": [],
        "baseline": _baseline(problem),
        "unused_devices": [],
        "unified_pool": None,
        # A mixture of experts: how many experts a token reads of how many, and whether the plan puts some
        # blocks' experts on another device than the rest of the block (each placement's `expert_blocks`).
        "experts_count": int(profile.get("expert_count") or 0),
        "experts_used": int(profile.get("expert_used_count") or 0),
        "places_experts": False,
        "objective": objective,
        # The split best for long prompts, when it is not the plan's (see `_prompt_option`).
        "prompt_option": None,
    }
    if by_hand:
        result["placed_by_hand"] = True
        result["planner_tokens_per_s"] = _tps(planner_seconds)
    if split is None:
        result["suggestions"] = suggestions(profile, nodes, settings)
        result["shortfall_bytes"] = extra_device_bytes(profile, nodes, settings)
        return result
    ev = evaluate(problem, split)
    placements = _placements(problem, split, ev)
    used = {(p["node"], p["device"]) for p in placements}
    result["unused_devices"] = [
        f"{s.node.name}/{s.device.name}" for s in problem.slots if (s.node.name, s.device.name) not in used
    ]
    if result["unused_devices"]:
        why = "Left out by hand: " if by_hand else "Left out because they would not make it faster: "
        warnings.append(why + ", ".join(result["unused_devices"]) + ".")
    if by_hand and not ev.fits:
        result["fits"] = False
        warnings.append("This split does not fit the devices' memory.")
    if not result["baseline"]["fits"]:
        warnings.append(
            "llama.cpp's default split would run out of memory on "
            + ", ".join(result["baseline"]["over_capacity"])
            + "."
        )
    result.update(
        places_experts=any(
            not p["first_layer"] <= b < p["first_layer"] + p["layers"]
            for p in placements
            for b in p["expert_blocks"]
        ),
        placements=placements,
        unified_pool=unified_pool(problem, placements),
        predicted_tokens_per_s=_tps(seconds),
        # The same split with an empty KV cache, and the cells the context holds: the measure step compares
        # a measurement with the prediction at the context it filled (planning/speed_check.py).
        predicted_tokens_per_s_empty=_tps(evaluate(_without_kv(problem), split).seconds_per_token),
        kv_cells=kv_cells(settings)[1],
        pipeline_parallel=pipeline_parallel(split),
        speed_model=speed_model(problem, split),
        first_word=first_word(problem, split),
        prompt_option=_prompt_option(problem, split) if objective != "prompt" and not by_hand else None,
        decode_option=(
            None
            if by_hand or decode_split is None or _same(split, decode_split)
            else {
                "predicted_tokens_per_s": _tps(evaluate(problem, decode_split).seconds_per_token),
                "first_word": first_word(problem, decode_split),
            }
        ),
        llama_server_args=llama_server_args(placements, _settings_dict(settings), n_layer),
        rpc_servers=_rpc_servers(placements, problem),
    )
    return result
