"""From Deploy to the first word (issue 20): how long a split takes to load, and to answer the first token
of a long prompt. Pure Python, no Django; the decode model is planning/costs.py.

**The first token** after an N-token prompt is prompt processing, which is compute-bound. llama.cpp cuts the
prompt into ubatches of `settings.ubatch` tokens; each ubatch passes the devices of the split in order (the
coordinator's CPU first, with its blocks and the input embedding, then the devices of `Split.order`). A stage
of one ubatch costs

    its blocks' floating-point work for those tokens / the device's prompt throughput (FLOP/s)
    + on a remote node: its hop and RPC_ROUND_TRIPS_PER_TOKEN round trips, and the activations in
      (ubatch x n_embd x 4 bytes, f32) when the previous stage is on another node, and out when the next
      one is, over the link's throughput
    + on the coordinator's CPU: the fixed cost of a pass.

A block's work per token is twice its matrices' parameter count (from the model's shape, so a quantised model
costs what its arithmetic costs) plus the attention over the positions before it. Without pipeline
parallelism the stages run one after another; with it (every block offloaded to several devices) llama.cpp
overlaps the ubatches of one batch (`-b`, 2048 tokens) across the devices: a flow shop, stage s of ubatch j
starting when stage s-1 of j and stage s of j-1 are done. The output layer runs for the last token only.

**Loading**, cold: every byte a worker holds crosses its link (one worker after another: llama.cpp loads the
tensors in order), and the coordinator reads its own share from its disk. Warm: ggml-rpc-server's cache
(`-c`) holds every tensor above HASH_THRESHOLD (256 KiB in RAMDeck's builds; llamacpp/rpc_cache.py): such a
tensor costs one round trip for its hash and a read from the worker's own disk, and only the smaller ones
cross the link. Both add llama-server's own start (`LOAD_FIXED_S`) and its hashing of every tensor it
offers by hash (`HASH_MBS`).

Each device's prompt throughput and each worker's link throughput come from calibration (calibration/job.py)
where it measured them; otherwise the defaults below, and the figure says so (`sources`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from planning.cluster import RPC_ROUND_TRIPS_PER_TOKEN, Settings
from planning.costs import DEFAULT_BATCH, Problem, Slot, Split, evaluate, kv_cells, pipeline_parallel

# The prompt length the plan page prices and the measure step measures.
PROMPT_TOKENS = 2000

# An uncalibrated device's prompt throughput, GFLOP/s (f16 matrix products at a 512-token ubatch: a desktop
# CPU of a few cores, a mid-range GPU), and link throughput, MB/s (gigabit Ethernet after TCP's overhead).
DEFAULT_PROMPT_GFLOPS = {"cpu": 50.0, "cuda": 5000.0, "rocm": 5000.0, "metal": 2000.0, "vulkan": 2000.0}
DEFAULT_LINK_MBS = 110.0
# A disk's sequential read, MB/s: the coordinator's share of the file, a worker's cache entries.
DEFAULT_DISK_MBS = 500.0
# llama-server's own start: the process, its HTTP server, reading the GGUF's header, reserving the compute
# buffers, warming up (0.14 to 0.40 s for a 528 MiB model loaded from local disk on the lab's machine,
# benchmarks/first_word.py `local_disk_s`).
LOAD_FIXED_S = 0.3
# llama-server hashes every tensor it offers a worker's cache (FNV-1a, one byte at a time, before each is
# offered, cold or warm): 0.65 s of a warm load's 0.71 s of llama-server's CPU for 395 MiB on the lab's
# machine (perf), about 600 to 800 MB/s.
HASH_MBS = 700.0

# The plan page offers the split that is best for long prompts only when it is at least this much faster to
# the first token than the plan's.
BETTER_BY = 0.10
# A split best for long prompts is the plan itself when it decodes within this of the fastest split (and
# reaches the first token BETTER_BY sooner): planning/planner.py `_first_word_tie`.
DECODE_TIE = 0.03


def _per_layer(value: Any, n: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value] + [int(value[-1])] * (n - len(value)) if value else [0] * n
    return [int(value or 0)] * n


def block_flops(profile: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Per block: (FLOPs per token of its matrix products, FLOPs per token per position before it of its
    attention). From the model's shape: queries, keys, values and output projections, the feed-forward's three
    matrices (of the experts a token is routed to, for a mixture), and QK^T and softmax·V."""
    n = int(profile["block_count"])
    n_embd = int(profile["embedding_length"])
    heads = _per_layer(profile.get("head_count"), n)
    heads_kv = _per_layer(profile.get("head_count_kv") or profile.get("head_count"), n)
    head_dim = n_embd // max(1, max(heads))
    keys = _per_layer(profile.get("key_length") or head_dim, n)
    values = _per_layer(profile.get("value_length") or head_dim, n)
    n_ff = _per_layer(profile.get("feed_forward_length") or 4 * n_embd, n)
    used = max(1, int(profile.get("expert_used_count") or 1))
    matrices, attention = [], []
    for il in range(n):
        h, hkv, k, v = heads[il], heads_kv[il], keys[il], values[il]
        params = n_embd * (h * k + hkv * k + hkv * v) + h * v * n_embd + 3 * n_embd * n_ff[il] * used
        matrices.append(2.0 * params)
        attention.append(2.0 * h * (k + v))
    return matrices, attention


def output_flops(profile: dict[str, Any]) -> float:
    return 2.0 * int(profile["embedding_length"]) * int(profile.get("vocab_size") or 32000)


def prompt_rate(slot: Slot) -> float:
    """The device's prompt throughput in FLOP/s."""
    gflops = slot.device.prompt_gflops or DEFAULT_PROMPT_GFLOPS.get(slot.device.kind, 50.0)
    return gflops * 1e9


def link_rate(slot: Slot) -> float:
    """The coordinator-to-worker link's throughput for large transfers, bytes/s."""
    return (slot.node.link_mbs or DEFAULT_LINK_MBS) * 1e6


def _rtt_s(slot: Slot) -> float:
    return slot.network_s / RPC_ROUND_TRIPS_PER_TOKEN if slot.remote else 0.0


def _stages(problem: Problem, split: Split) -> list[tuple[Slot, int, int, bool]]:
    """(slot, first block, blocks, holds the output layer) in the order a ubatch passes them."""
    out = [(problem.cpu, 0, split.cpu_blocks, not split.order)]
    start = split.cpu_blocks
    for k, (i, count) in enumerate(zip(split.order, split.counts, strict=True)):
        out.append((problem.slots[i], start, count, k == len(split.order) - 1))
        start += count
    return out


def ubatches(n_tokens: int, ubatch: int) -> list[list[tuple[int, int]]]:
    """The prompt as llama.cpp cuts it: batches of at most DEFAULT_BATCH tokens, each of ubatches of at most
    `ubatch` tokens, as (first position, tokens)."""
    batch = max(ubatch, min(DEFAULT_BATCH, n_tokens))
    out: list[list[tuple[int, int]]] = []
    for b0 in range(0, n_tokens, batch):
        b_end = min(n_tokens, b0 + batch)
        out.append([(p, min(ubatch, b_end - p)) for p in range(b0, b_end, ubatch)])
    return out


def stage_seconds(problem: Problem, split: Split, p0: int, tokens: int, *, last_ubatch: bool) -> list[float]:
    """Seconds each stage of the split spends on one ubatch of `tokens` tokens starting at position `p0`."""
    matrices, attention = block_flops(problem.profile)
    n_embd = int(problem.profile["embedding_length"])
    # Σ over the ubatch's tokens of the positions each attends to (itself and those before it).
    positions = tokens * p0 + tokens * (tokens + 1) / 2
    stages = _stages(problem, split)
    out = []
    for k, (slot, first, count, output) in enumerate(stages):
        work = (
            sum(matrices[first : first + count]) * tokens + sum(attention[first : first + count]) * positions
        )
        if output and last_ubatch:
            work += output_flops(problem.profile)
        seconds = work / prompt_rate(slot)
        if slot is problem.cpu:
            seconds += problem.fixed_s
        elif slot.remote and (count or output):
            activations = tokens * n_embd * 4
            prev_node = stages[k - 1][0].node.name
            nxt = next((s for s, _, c, o in stages[k + 1 :] if c or o), None)
            moved = activations if prev_node != slot.node.name else 0
            moved += activations if nxt is not None and nxt.node.name != slot.node.name else 0
            hop = slot.overhead_s - slot.network_s
            seconds += hop + RPC_ROUND_TRIPS_PER_TOKEN * _rtt_s(slot) + moved / link_rate(slot)
        out.append(seconds)
    return out


def predict_ttft(problem: Problem, split: Split, n_tokens: int | None = None) -> float:
    """Seconds from the prompt's arrival to its first token (see the module's docstring); the prompt's
    length by default `prompt_tokens`."""
    n_tokens = n_tokens or prompt_tokens(problem.settings)
    pipelined = pipeline_parallel(split)
    total = 0.0
    batches = ubatches(n_tokens, problem.settings.ubatch)
    for b, batch in enumerate(batches):
        rows = [
            stage_seconds(problem, split, p0, t, last_ubatch=b == len(batches) - 1 and j == len(batch) - 1)
            for j, (p0, t) in enumerate(batch)
        ]
        if not pipelined:
            total += sum(sum(row) for row in rows)
            continue
        done = np.zeros(len(rows[0]))  # when each stage finished the previous ubatch
        for row in rows:
            ready = 0.0
            for s, seconds in enumerate(row):
                ready = max(ready, done[s]) + seconds
                done[s] = ready
        total += float(done[-1])
    return total


def _tensor_figures(profile: dict[str, Any], first: int, count: int, output: bool) -> tuple[int, int] | None:
    """(bytes in tensors at or below HASH_THRESHOLD, count of tensors above it) of blocks first..first+count
    and the output layer; None when the profile was read before these were recorded."""
    small, large = profile.get("block_small_bytes"), profile.get("block_large_tensors")
    if small is None or large is None:
        return None
    out_small = int(profile.get("output_small_bytes") or 0) if output else 0
    out_large = int(profile.get("output_large_tensors") or 0) if output else 0
    return (
        sum(int(x) for x in small[first : first + count]) + out_small,
        sum(int(x) for x in large[first : first + count]) + out_large,
    )


def predict_load(problem: Problem, split: Split) -> dict[str, Any]:
    """{"cold_s", "warm_s" (None when the profile lacks the tensor sizes), "worker_bytes",
    "warm_worker_bytes", "local_bytes"}: the load time from llama-server's start to its health answer."""
    ev = evaluate(problem, split)
    local = 0
    per_node: dict[str, dict[str, float]] = {}
    warm_known = True
    for part in ev.parts:
        if not part.slot.remote:
            local += part.weights
            continue
        if not part.blocks and not part.holds_output:
            continue
        node = per_node.setdefault(
            part.slot.node.name,
            {"bytes": 0, "small": 0, "large": 0, "link": link_rate(part.slot), "rtt": _rtt_s(part.slot)},
        )
        node["bytes"] += part.weights
        figures = _tensor_figures(problem.profile, part.first_block, part.blocks, part.holds_output)
        if figures is None:
            warm_known = False
        else:
            node["small"] += figures[0]
            node["large"] += figures[1]
    disk, hashing = DEFAULT_DISK_MBS * 1e6, HASH_MBS * 1e6
    base = LOAD_FIXED_S + local / disk
    # What the cache path costs whether it hits or not: llama-server hashes each such tensor first.
    hashed = sum(n["bytes"] - n["small"] for n in per_node.values()) / hashing if warm_known else 0.0
    cold = base + hashed + sum(n["bytes"] / n["link"] for n in per_node.values())
    warm = None
    if warm_known:
        # Warm: the small tensors over the link, a round trip per cached one, which the worker reads from its
        # disk into its buffer.
        warm = (
            base
            + hashed
            + sum(
                n["small"] / n["link"] + n["large"] * n["rtt"] + (n["bytes"] - n["small"]) / disk
                for n in per_node.values()
            )
        )
    return {
        "cold_s": round(cold, 3),
        "warm_s": None if warm is None else round(warm, 3),
        "worker_bytes": int(sum(n["bytes"] for n in per_node.values())),
        "warm_worker_bytes": int(sum(n["small"] for n in per_node.values())) if warm_known else None,
        "local_bytes": int(local),
    }


def prompt_tokens(settings: Settings) -> int:
    """The prompt the first token is priced after: PROMPT_TOKENS, or what one slot's context holds with room
    for the answer (the measure step sends the same length, deployments/steps/checks.py)."""
    per_seq, _ = kv_cells(settings)
    return max(16, min(PROMPT_TOKENS, min(settings.ctx // settings.parallel, per_seq) - 16))


def first_word(problem: Problem, split: Split, n_tokens: int | None = None) -> dict[str, Any]:
    """What the plan page shows beside decode speed: time to the first token and the load, for one split."""
    n_tokens = n_tokens or prompt_tokens(problem.settings)
    return {
        "prompt_tokens": n_tokens,
        "ttft_s": round(predict_ttft(problem, split, n_tokens), 3),
        "ttft_curve": ttft_curve(problem, split),
        "load": predict_load(problem, split),
    }


def prompt_problem(problem: Problem, n_tokens: int | None = None) -> Problem:
    """The problem as a long prompt sees it, for the decode search (planning/waterfill.py) to minimise the
    time to the first token instead: each block's "read" is its work for the whole prompt, each device's
    "bandwidth" its prompt throughput, each remote node's overhead its hops, round trips and activations over
    the prompt's ubatches. Memory is the same. The search ignores pipelining; `predict_ttft` then prices what
    it finds exactly."""
    n_tokens = n_tokens or prompt_tokens(problem.settings)
    matrices, attention = block_flops(problem.profile)
    positions = n_tokens * (n_tokens + 1) / 2
    read = [m * n_tokens + a * positions for m, a in zip(matrices, attention, strict=True)]
    n_ub = math.ceil(n_tokens / problem.settings.ubatch)
    moved = 2 * n_tokens * int(problem.profile["embedding_length"]) * 4

    def convert(slot: Slot) -> Slot:
        if not slot.remote:
            return replace(slot, bandwidth=prompt_rate(slot), burst_s=0.0)
        hop = (slot.overhead_s - slot.network_s) * n_ub
        network = RPC_ROUND_TRIPS_PER_TOKEN * _rtt_s(slot) * n_ub + moved / link_rate(slot)
        return replace(
            slot, bandwidth=prompt_rate(slot), overhead_s=hop + network, network_s=network, burst_s=0.0
        )

    return replace(
        problem,
        cpu=convert(problem.cpu),
        slots=[convert(s) for s in problem.slots],
        read_bytes=read,
        read_prefix=np.concatenate([[0.0], np.cumsum(np.array(read, dtype=np.float64))]),
        expert_read=[0.0] * len(read),
        expert_bytes=[0] * len(read),
        fixed_s=problem.fixed_s * n_ub,
        pipeline_s=0.0,
    )


# ---------------------------------------------------------------------------------------------------------
# Measured against predicted (the measure step, the deployment page)

# The prompt lengths a plan prices, so that a measurement of another length (a context too small for
# PROMPT_TOKENS) is set beside the prediction at its own length.
CURVE_TOKENS = (128, 512, 1000, PROMPT_TOKENS)

# A miss beyond this either way is flagged, as decode's is (planning/speed_check.py).
ERROR_LIMIT = 0.25


def ttft_curve(problem: Problem, split: Split) -> list[list[float]]:
    return [[n, round(predict_ttft(problem, split, n), 4)] for n in CURVE_TOKENS]


def ttft_at(figures: dict[str, Any], n_tokens: float) -> float | None:
    """The plan's predicted first token for an `n_tokens` prompt, between the lengths it priced (straight
    lines between them; beyond the last, the last line's slope). None for a plan made before issue 20."""
    curve = [(float(n), float(s)) for n, s in (figures or {}).get("ttft_curve") or []]
    if not curve:
        return None
    points = [(0.0, 0.0), *curve]
    for (n0, s0), (n1, s1) in zip(points, points[1:], strict=False):
        if n_tokens <= n1 or (n1, s1) == points[-1]:
            return s0 + (s1 - s0) * (n_tokens - n0) / (n1 - n0)
    return None


def error(measured: float | None, predicted: float | None) -> float | None:
    """(measured - predicted) / predicted time: +0.5 took half as long again as predicted."""
    if not measured or not predicted:
        return None
    return (measured - predicted) / predicted


def is_off(value: float | None) -> bool:
    return value is not None and abs(value) > ERROR_LIMIT
