"""The clamped waterfill planner: which devices run which blocks of a model, and how fast that will be.

Pure Python (numpy for the dynamic programme), no Django. Input: a model profile
(deployments/gguf_profile.py), a cluster (nodes with devices, one coordinator) and settings. Output: a
JSON-able plan (see `plan`).

The model of memory (per device, llama.cpp's own accounting, checked against real logs in
tests/test_planner_vs_llamacpp.py):
    weights of its blocks + KV cache of its blocks + compute buffer estimate (+ the output layer on the last
    device; + the input embedding on the coordinator's CPU) <= capacity,
    capacity = min(free, clamp x total) for unified-memory devices, min(free, total) otherwise,
               minus a margin.

The model of speed (single-stream decode is memory-bandwidth bound):
    seconds per token = sum over devices of (weight bytes + KV bytes it holds) / its bandwidth
                        + RPC_ROUND_TRIPS_PER_TOKEN x round-trip time for every remote node in use.

The search: llama.cpp keeps the first blocks on the coordinator's CPU and gives the rest to the listed devices
as contiguous slices, the output layer with the last one. For each choice of last device, the other devices
are put in a canonical order (nodes by their fastest device, devices by bandwidth) and a dynamic programme
over "blocks placed so far" picks the exact block count of every device (0 = leave it out) minimising
predicted time under the memory limits. When all blocks have the same size (as in real models, up to
quantisation mixes), device order only matters through which device is last, so the result is optimal
over every order and split; tests prove it against exhaustive search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from . import llamacpp

MIB = 1024 * 1024
GIB = 1024 * MIB
MAX_DEVICES = 15  # llama.cpp's -ts takes at most this many entries
# Per generated token llama.cpp's RPC client does about three request/response exchanges with each server it
# computes on (set the input activations, run the graph, read the output activations back), so a remote node
# costs three round-trip times per token on top of its memory-bandwidth time.
RPC_ROUND_TRIPS_PER_TOKEN = 3
DEFAULT_RTT_MS = 1.0
# Bytes per element, as (block bytes, block elements) of the ggml type.
KV_TYPES = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
# ggml_backend_sched keeps this many copies of the compute graph when pipeline parallelism is on.
PIPELINE_COPIES = 4
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


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    devices: tuple[Device, ...]
    coordinator: bool = False
    rpc_port: int = 50052
    rtt_ms: float | None = None


@dataclass(frozen=True)
class Settings:
    ctx: int = 4096
    parallel: int = 1
    cache_type: str = "f16"
    clamp: float = 0.70
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


# ---------------------------------------------------------------------------------------------------------
# Cluster descriptions


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
                devices.append(
                    Device(
                        node=name,
                        name=str(dev["name"]),
                        kind=kind,
                        total_bytes=total,
                        free_bytes=min(free, total),
                        bandwidth_gbs=bandwidth,
                        unified=bool(dev.get("unified", False)),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ClusterError(f"Node {name!r}, device #{j + 1}: bad or missing {exc}.") from None
            if bandwidth <= 0 or total < 0:
                raise ClusterError(
                    f"Node {name!r}, device {dev['name']!r}: bandwidth and memory must be positive."
                )
        rtt = raw.get("rtt_ms")
        nodes.append(
            Node(
                name=name,
                address=str(raw.get("address") or "127.0.0.1"),
                devices=tuple(devices),
                coordinator=bool(raw.get("coordinator", False)),
                rpc_port=int(raw.get("rpc_port") or 50052),
                rtt_ms=float(rtt) if rtt is not None else None,
            )
        )
    validate_cluster(nodes)
    return nodes


def validate_cluster(nodes: Sequence[Node]) -> None:
    coordinators = [n for n in nodes if n.coordinator]
    if len(coordinators) != 1:
        raise ClusterError(f"Exactly one node must be the coordinator (found {len(coordinators)}).")
    if not any(d.name == "CPU" for d in coordinators[0].devices):
        raise ClusterError(f"The coordinator {coordinators[0].name!r} needs a CPU device (its RAM).")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ClusterError("Node names must be unique.")
    for node in nodes:
        dev_names = [d.name for d in node.devices]
        if len(set(dev_names)) != len(dev_names):
            raise ClusterError(f"Node {node.name!r} lists a device twice.")
    offload = sum(len(n.devices) - (1 if n.coordinator else 0) for n in nodes)
    if offload > MAX_DEVICES:
        raise ClusterError(
            f"{offload} devices besides the coordinator's CPU; llama.cpp allows at most {MAX_DEVICES}."
        )


# ---------------------------------------------------------------------------------------------------------
# Memory of one model


def kv_cells(settings: Settings) -> tuple[int, int]:
    """(cells per sequence, total cells) as llama.cpp sizes them for -c/-np without --kv-unified."""
    n_ctx = -(-settings.ctx // 256) * 256
    per_seq = -(-(n_ctx // settings.parallel) // 256) * 256
    return per_seq, per_seq * settings.parallel


def _row_bytes(n_elements: int, cache_type: str) -> int:
    block_bytes, block_elems = KV_TYPES[cache_type]
    return n_elements // block_elems * block_bytes


def kv_bytes_per_block(profile: dict[str, Any], settings: Settings) -> list[int]:
    """KV cache bytes of every block (sliding-window layers hold fewer cells)."""
    per_seq, total = kv_cells(settings)
    swa_cells = total
    if profile.get("sliding_window"):
        # llama_kv_cache_iswa: min(size, n_swa + n_ubatch) per stream, padded to 256.
        swa = min(per_seq, -(-(profile["sliding_window"] + settings.ubatch) // 256) * 256)
        swa_cells = swa * settings.parallel
    out = []
    swa_layers = profile.get("swa_layers") or [False] * profile["block_count"]
    for il in range(profile["block_count"]):
        cells = swa_cells if swa_layers[il] else total
        n_kv = profile["head_count_kv"][il]
        k = _row_bytes(n_kv * profile["key_length"][il], settings.cache_type)
        v = _row_bytes(n_kv * profile["value_length"][il], settings.cache_type)
        out.append(cells * (k + v))
    return out


def compute_bytes(
    profile: dict[str, Any], settings: Settings, *, role: str, coordinator_cpu: bool, pipeline: bool = False
) -> int:
    """An upper estimate of one copy of a device's compute buffer (ggml_backend_sched's reservation).

    No closed form exists; this is fitted to llama.cpp's own logs on its CPU and RPC backends with flash
    attention (its default) and kept above them (tests/test_planner_vs_llamacpp.py holds it to within 2x).
    Per ubatch token: f32 activations, plus the f16 attention mask over the cells of one sequence.
    `role`: "mid" (blocks, no output), "out" (blocks and the output layer), "tail" (the output layer and at
    most the last block, whose feed-forward runs on the output rows only), "idle" (the coordinator's CPU
    computing no block: input embeddings and the mask). With pipeline parallelism the graph is cut into
    more, smaller splits, so the feed-forward share is smaller (but there are four copies).
    """
    per_seq, _ = kv_cells(settings)
    ub = min(settings.ubatch, per_seq)
    n_embd = int(profile["embedding_length"])
    n_ff = profile.get("feed_forward_length") or 4 * n_embd
    n_ff = max(n_ff) if isinstance(n_ff, list) else int(n_ff)
    n_ff *= max(1, int(profile.get("expert_used_count") or 1))
    n_vocab = int(profile.get("vocab_size") or 32000)
    if role == "idle":
        floats = 4 * n_embd
    elif role == "tail":
        floats = 5 * n_embd
    else:
        floats = n_ff + 4 * n_embd if pipeline else 3 * n_ff + 5 * n_embd
    if role in ("out", "tail"):
        # The logits replace the activations once the last block is done, so the peak is the larger one.
        floats = max(floats, n_vocab + 2 * n_embd)
    if coordinator_cpu:
        floats += n_vocab if role == "idle" else n_embd + n_vocab
    return ub * (4 * floats + 2 * per_seq)


def capacity_bytes(device: Device, settings: Settings) -> tuple[int, int]:
    """(limit, capacity): the memory a device may use at all, and that minus the safety margin."""
    limit = (
        min(device.free_bytes, int(settings.clamp * device.total_bytes))
        if device.unified
        else device.free_bytes
    )
    limit = max(0, limit)
    return limit, max(0, int(limit * (1 - settings.margin_fraction)))


# ---------------------------------------------------------------------------------------------------------
# The problem in numbers


@dataclass
class Slot:
    """One offload device as the search sees it."""

    device: Device
    node: Node
    remote: bool
    limit: int
    capacity: int
    bandwidth: float  # bytes per second
    overhead_s: float  # per-token RPC cost of its node
    # Bytes of one compute-graph copy by (role, pipeline parallelism on); see `compute_bytes`.
    compute: dict[tuple[str, bool], int] = field(default_factory=dict)

    def compute_for(self, role: str, copies: int) -> int:
        return self.compute[(role, copies > 1)] * copies


@dataclass
class Problem:
    profile: dict[str, Any]
    settings: Settings
    nodes: list[Node]
    coordinator: Node
    cpu: Slot
    slots: list[Slot]
    block_bytes: list[int]  # weights + KV of each block
    weights: list[int]
    kv: list[int]
    prefix: np.ndarray  # prefix sums of block_bytes, float64
    cpu_base: int  # input embedding and other non-block tensors, on the coordinator's CPU
    warnings: list[str] = field(default_factory=list)


def _compute_table(profile: dict[str, Any], settings: Settings, *, coordinator_cpu: bool) -> dict:
    return {
        (role, pp): compute_bytes(profile, settings, role=role, coordinator_cpu=coordinator_cpu, pipeline=pp)
        for role in ("mid", "out", "tail", "idle")
        for pp in (False, True)
    }


def build_problem(profile: dict[str, Any], nodes: Sequence[Node], settings: Settings) -> Problem:
    settings.validate()
    validate_cluster(nodes)
    coordinator = next(n for n in nodes if n.coordinator)
    warnings: list[str] = []
    weights = [int(b) for b in profile["block_weight_bytes"]]
    kv = kv_bytes_per_block(profile, settings)
    block_bytes = [w + k for w, k in zip(weights, kv, strict=True)]
    prefix = np.concatenate([[0.0], np.cumsum(np.array(block_bytes, dtype=np.float64))])

    def slot(device: Device, node: Node) -> Slot:
        limit, capacity = capacity_bytes(device, settings)
        remote = not node.coordinator
        rtt = node.rtt_ms
        if remote and rtt is None:
            rtt = DEFAULT_RTT_MS
            msg = f"No round-trip time known for {node.name}; assumed {DEFAULT_RTT_MS} ms."
            if msg not in warnings:
                warnings.append(msg)
        return Slot(
            device=device,
            node=node,
            remote=remote,
            limit=limit,
            capacity=capacity,
            bandwidth=device.bandwidth_gbs * 1e9,
            overhead_s=RPC_ROUND_TRIPS_PER_TOKEN * (rtt or 0.0) / 1000.0 if remote else 0.0,
            compute=_compute_table(profile, settings, coordinator_cpu=False),
        )

    cpu_device = next(d for d in coordinator.devices if d.name == "CPU")
    cpu = slot(cpu_device, coordinator)
    unified_gpus = [d for d in coordinator.devices if d.unified and d.name != "CPU"]
    if unified_gpus:
        # The CPU and a unified GPU share one pool of RAM: do not count it twice.
        shared = sum(capacity_bytes(d, settings)[0] for d in unified_gpus)
        cpu.limit = max(0, min(cpu.limit, cpu_device.total_bytes - shared))
        cpu.capacity = int(cpu.limit * (1 - settings.margin_fraction))
    cpu.compute = _compute_table(profile, settings, coordinator_cpu=True)
    slots = [slot(d, coordinator) for d in coordinator.devices if d.name != "CPU"]
    for node in nodes:
        if not node.coordinator:
            slots += [slot(d, node) for d in node.devices]
    cpu_base = int(profile.get("input_embedding_bytes", 0)) + int(profile.get("other_bytes", 0))
    return Problem(
        profile,
        settings,
        list(nodes),
        coordinator,
        cpu,
        slots,
        block_bytes,
        weights,
        kv,
        prefix,
        cpu_base,
        warnings,
    )


# ---------------------------------------------------------------------------------------------------------
# Evaluating one split (the model the search optimises; tests use it for exhaustive search)


@dataclass
class Split:
    """cpu_blocks first blocks on the coordinator's CPU, then `counts[i]` blocks on `order[i]` (slot index);
    the output layer on the last entry of `order`, or on the CPU when `order` is empty."""

    cpu_blocks: int
    order: list[int]
    counts: list[int]


@dataclass
class Evaluation:
    fits: bool
    seconds_per_token: float
    # Per entry: (slot or None for the CPU, first block, blocks, weights, kv, compute, output?)
    parts: list[tuple[Slot, int, int, int, int, int, bool]]


def pipeline_parallel(split: Split) -> bool:
    """llama.cpp turns on pipeline parallelism (x4 compute buffers) when all layers go to >1 device."""
    return split.cpu_blocks == 0 and len(split.order) > 1


def _role(is_cpu: bool, start: int, count: int, output: bool, n: int) -> str:
    if is_cpu:
        return "out" if output else ("idle" if count == 0 else "mid")
    if output:
        return "tail" if count <= 1 and start + count == n else "out"
    return "mid"


def evaluate(problem: Problem, split: Split) -> Evaluation:
    n = len(problem.block_bytes)
    if split.cpu_blocks + sum(split.counts) != n or len(split.order) != len(split.counts):
        raise ValueError("The split does not place every block exactly once.")
    copies = PIPELINE_COPIES if pipeline_parallel(split) else 1
    out_bytes = int(problem.profile["output_bytes"])
    parts = []
    seconds = 0.0
    fits = True
    entries = [(problem.cpu, split.cpu_blocks, not split.order)]
    entries += [
        (problem.slots[i], c, k == len(split.order) - 1)
        for k, (i, c) in enumerate(zip(split.order, split.counts, strict=True))
    ]
    start = 0
    used_nodes: set[str] = set()
    for slot, count, output in entries:
        weights = sum(problem.weights[start : start + count]) + (out_bytes if output else 0)
        if slot is problem.cpu:
            weights += problem.cpu_base
        kv = sum(problem.kv[start : start + count])
        compute = slot.compute_for(_role(slot is problem.cpu, start, count, output, n), copies)
        fits = fits and weights + kv + compute <= slot.capacity
        read = sum(problem.block_bytes[start : start + count]) + (out_bytes if output else 0)
        seconds += read / slot.bandwidth
        if slot.remote and slot.node.name not in used_nodes:
            used_nodes.add(slot.node.name)
            seconds += slot.overhead_s
        parts.append((slot, start, count, weights, kv, compute, output))
        start += count
    return Evaluation(fits, seconds, parts)


# ---------------------------------------------------------------------------------------------------------
# The search


def _canonical_groups(problem: Problem) -> list[list[int]]:
    """Slot indices grouped by node: nodes by their fastest device, devices by bandwidth (then by name)."""
    by_node: dict[str, list[int]] = {}
    for i, s in enumerate(problem.slots):
        by_node.setdefault(s.node.name, []).append(i)
    groups = [
        sorted(idx, key=lambda i: (-problem.slots[i].bandwidth, problem.slots[i].device.name))
        for idx in by_node.values()
    ]
    groups.sort(key=lambda g: (-problem.slots[g[0]].bandwidth, problem.slots[g[0]].node.name))
    return groups


def _order_for_last(groups: list[list[int]], last: int) -> list[list[int]]:
    out = [g for g in groups if last not in g]
    home = [i for i in next(g for g in groups if last in g) if i != last] + [last]
    return out + [home]


INF = math.inf


class _Search:
    """Dynamic programme over 'blocks placed so far' for a fixed device order (see module docstring)."""

    def __init__(self, problem: Problem):
        self.p = problem
        n = len(problem.block_bytes)
        self.n = n
        pre = problem.prefix
        span = pre[None, :] - pre[:, None]  # span[j, k] = bytes of blocks j..k-1
        self.span = span
        self.upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # k > j
        self.diag = np.eye(n + 1, dtype=bool)
        self.out_bytes = float(problem.profile["output_bytes"])
        self._cache: dict[tuple[int, bool, int], np.ndarray] = {}

    def matrix(self, i: int, last: bool, copies: int) -> np.ndarray:
        """Cost of giving blocks j..k-1 to slot i (inf where it does not fit or is not a use)."""
        key = (i, last, copies)
        if key not in self._cache:
            s = self.p.slots[i]
            fixed = s.compute_for("out" if last else "mid", copies) + (self.out_bytes if last else 0.0)
            if last:
                # Rows j >= n - 1: the output device holds at most the last block (smaller compute buffer).
                fixed = np.full((self.n + 1, 1), fixed)
                fixed[self.n - 1 :] = s.compute_for("tail", copies) + self.out_bytes
            ok = (self.span + fixed <= s.capacity) & (self.upper | (self.diag if last else False))
            cost = (self.span + (self.out_bytes if last else 0.0)) / s.bandwidth
            self._cache[key] = np.where(ok, cost, INF)
        return self._cache[key]

    def cpu_costs(self, copies: int, output: bool) -> np.ndarray:
        c = self.p.cpu
        fixed = (
            self.p.cpu_base
            + c.compute_for("out" if output else "mid", copies)
            + (self.out_bytes if output else 0)
        )
        pre = self.p.prefix
        if not output:
            # With no block of its own the CPU's compute buffer is much smaller.
            fixed = np.full(len(pre), float(fixed))
            fixed[0] = self.p.cpu_base + c.compute_for("idle", copies)
        ok = pre + fixed <= c.capacity
        return np.where(ok, (pre + (self.out_bytes if output else 0.0)) / c.bandwidth, INF)

    def run(
        self, order: list[list[int]], start: np.ndarray, copies: int, record: bool, *, has_last: bool = True
    ):
        """Returns final cost array and, when recording, the choices for backtracking.

        The last slot of `order` holds the output layer unless `has_last` is false (a shared prefix).
        """
        f = start
        trace: list[tuple] = []
        cols = np.arange(self.n + 1)
        last_slot = order[-1][-1] if has_last and order else -1
        for group in order:
            # A remote node with one device is a local device plus its overhead: no second state needed.
            remote = self.p.slots[group[0]].remote and len(group) > 1
            if remote:
                a, b = f, np.full_like(f, INF)
            for i in group:
                is_last = i == last_slot
                m = self.matrix(i, is_last, copies)
                if remote:
                    ovh = self.p.slots[i].overhead_s
                    from_a = a[:, None] + ovh + m
                    from_b = b[:, None] + m
                    if record:
                        ja, jb = from_a.argmin(0), from_b.argmin(0)
                        va, vb = from_a[ja, cols], from_b[jb, cols]
                    else:
                        va, vb = from_a.min(0), from_b.min(0)
                    keep_b = np.full_like(b, INF) if is_last else b
                    choice = np.stack(
                        [keep_b, va, vb]
                    )  # 0: skip this slot, 1: first use of the node, 2: more
                    pick = choice.argmin(0)
                    nb = choice[pick, cols]
                    na = np.full_like(a, INF) if is_last else a
                    if record:
                        trace.append(("r", i, pick, ja, jb))
                    a, b = na, nb
                else:
                    step = f[:, None] + (m + self.p.slots[i].overhead_s if self.p.slots[i].remote else m)
                    if record:
                        j = step.argmin(0)
                        v = step[j, cols]
                    else:
                        v = step.min(0)
                    if is_last:
                        pick = np.ones(self.n + 1, dtype=int)
                        nf = v
                    else:
                        better = v < f
                        pick = better.astype(int)
                        nf = np.where(better, v, f)
                    if record:
                        trace.append(("l", i, pick, j))
                    f = nf
            if remote:
                use_b = b < a
                if record:
                    trace.append(("merge", use_b))
                f = np.where(use_b, b, a)
        return f, trace

    def backtrack(self, trace, n: int) -> tuple[int, list[int], list[int]]:
        k = n
        state = None  # for remote groups: "a" or "b"
        order: list[int] = []
        counts: list[int] = []
        for entry in reversed(trace):
            if entry[0] == "merge":
                state = "b" if entry[1][k] else "a"
            elif entry[0] == "l":
                _, i, pick, j = entry
                if pick[k] == 1:
                    order.append(i)
                    counts.append(int(k - j[k]))
                    k = int(j[k])
            else:
                _, i, pick, ja, jb = entry
                if state == "a":
                    continue
                p = pick[k]
                if p == 0:
                    continue
                j = int(ja[k] if p == 1 else jb[k])
                order.append(i)
                counts.append(k - j)
                k = j
                state = "a" if p == 1 else "b"
        order.reverse()
        counts.reverse()
        return k, order, counts


def search(problem: Problem) -> tuple[Split | None, float]:
    """The best split under the model, or (None, inf) when nothing fits."""
    s = _Search(problem)
    n = s.n
    best: tuple[float, Split] | None = None

    def consider(cost: float, split: Split) -> None:
        nonlocal best
        if cost < INF and (best is None or cost < best[0] * (1 - 1e-12)):
            best = (cost, split)

    # Everything on the coordinator's CPU.
    everything = s.cpu_costs(1, output=True)
    consider(float(everything[n]), Split(n, [], []))
    groups = _canonical_groups(problem)
    best_run: tuple[float, list[list[int]], np.ndarray, int] | None = None
    start = s.cpu_costs(1, output=False)
    # Mode 1: some blocks stay on the CPU (no pipeline parallelism): CPU count >= 1.
    start1 = start.copy()
    start1[0] = INF
    # Mode 2: nothing on the CPU and a single device (no pipeline parallelism).
    start2 = np.full(n + 1, INF)
    start2[0] = start[0]
    # Mode 3: nothing on the CPU, pipeline parallelism on (x4 compute everywhere).
    start3 = np.full(n + 1, INF)
    start3[0] = s.cpu_costs(PIPELINE_COPIES, output=False)[0]
    modes = ((start1, 1), (start3, PIPELINE_COPIES))
    # The order for a last device in group k starts with groups 1..k-1 in canonical order: share that prefix.
    prefixes = []
    for st, copies in modes:
        states = [st]
        for group in groups[:-1]:
            states.append(s.run([group], states[-1], copies, record=False, has_last=False)[0])
        prefixes.append(states)
    for k, group in enumerate(groups):
        for last in group:
            slot = problem.slots[last]
            if slot.compute_for("tail", 1) + s.out_bytes > slot.capacity:
                continue  # it cannot hold the output layer at all
            order = _order_for_last(groups, last)
            rest = order[k:]  # after the shared prefix groups[:k]
            runs = [
                (prefixes[0][k], 1, rest, order, start1),
                (start2, 1, [[last]], [[last]], start2),
                (prefixes[1][k], PIPELINE_COPIES, rest, order, start3),
            ]
            for st_k, copies, tail_order, full_order, st in runs:
                f, _ = s.run(tail_order, st_k, copies, record=False)
                if f[n] < INF and (best_run is None or f[n] < best_run[0] * (1 - 1e-12)):
                    # A mode-3 optimum on a single device is never strictly better than mode 2 on it.
                    best_run = (float(f[n]), full_order, st, copies)
    if best_run is not None:
        cost, ord_, st, copies = best_run
        _, trace = s.run(ord_, st, copies, record=True)
        consider(cost, Split(*s.backtrack(trace, n)))
    if best is None:
        return None, INF
    return best[1], best[0]


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


def baseline_split(problem: Problem) -> Split:
    """llama.cpp's split proportional to reported free memory with every layer offloaded."""
    devices = default_split_devices(problem)
    n = len(problem.block_bytes)
    if not devices:
        return Split(n, [], [])
    shares = llamacpp.layer_assignment([problem.slots[i].device.free_bytes for i in devices], n, n + 1)
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
    for i in split.order:
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
    for i in split.order:
        if not problem.slots[i].remote:
            names[i] = (problem.slots[i].device.name, None, 0)
    return names


def _placements(problem: Problem, split: Split, evaluation: Evaluation) -> list[dict[str, Any]]:
    names = _llama_names(problem, split)
    out = []
    for slot, first, count, weights, kv, compute, output in evaluation.parts:
        is_cpu = slot is problem.cpu
        if not is_cpu and count == 0 and not output:
            continue
        llama_device, endpoint, server_index = (
            ("CPU", None, 0) if is_cpu else names[problem.slots.index(slot)]
        )
        read = sum(problem.block_bytes[first : first + count]) + (
            int(problem.profile["output_bytes"]) if output else 0
        )
        used = weights + kv + compute
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
                "weights_bytes": weights,
                "kv_bytes": kv,
                "compute_bytes": compute,
                "used_bytes": used,
                "capacity_bytes": slot.capacity,
                "limit_bytes": slot.limit,
                "total_bytes": slot.device.total_bytes,
                "free_bytes": slot.device.free_bytes,
                "unified": slot.device.unified,
                "bandwidth_gbs": slot.device.bandwidth_gbs,
                "fits": used <= slot.capacity,
                "ms_per_token": round(
                    1000 * read / slot.bandwidth + (slot.overhead_s * 1000 if count or output else 0), 4
                ),
            }
        )
    return out


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
        entry["args"] = llamacpp.rpc_server_args(entry["address"], entry["port"], entry["devices"])
    return list(servers.values())


def _tps(seconds: float) -> float | None:
    return round(1.0 / seconds, 3) if seconds > 0 and seconds < INF else None


def _baseline(problem: Problem) -> dict[str, Any]:
    split = baseline_split(problem)
    ev = evaluate(problem, split)
    placements = _placements(problem, split, ev)
    return {
        "fits": ev.fits,
        "placements": placements,
        "predicted_tokens_per_s": _tps(ev.seconds_per_token),
        "over_capacity": [f"{p['node']}/{p['device']}" for p in placements if not p["fits"]],
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

    if settings.ctx > 256:
        lo, hi = 0, (settings.ctx - 1) // 256  # largest k with ctx = 256 k fitting, 0 = none
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
    offload = sum(len(n.devices) - (1 if n.coordinator else 0) for n in nodes)
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


def _settings_dict(settings: Settings) -> dict[str, Any]:
    return asdict(settings)


def plan(profile: dict[str, Any], nodes: Sequence[Node], settings: Settings | None = None) -> dict[str, Any]:
    """The plan: a JSON-able dict (keys documented in issue 4; extra keys for the preview page)."""
    settings = settings or Settings()
    problem = build_problem(profile, nodes, settings)
    split, seconds = search(problem)
    warnings = list(problem.warnings)
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
    }
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
        warnings.append(
            "Left out because they would not make it faster: " + ", ".join(result["unused_devices"]) + "."
        )
    if not result["baseline"]["fits"]:
        warnings.append(
            "llama.cpp's default split would run out of memory on "
            + ", ".join(result["baseline"]["over_capacity"])
            + "."
        )
    result.update(
        placements=placements,
        predicted_tokens_per_s=_tps(seconds),
        pipeline_parallel=pipeline_parallel(split),
        llama_server_args=llamacpp.llama_server_args(placements, _settings_dict(settings), n_layer),
        rpc_servers=_rpc_servers(placements, problem),
    )
    return result
