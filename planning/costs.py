"""The planner's model of a deployment: the cluster, the settings, and what one split costs.

Pure Python, no Django. Memory per device follows llama.cpp's own accounting (checked against real logs in
tests/planning/test_planner_vs_llamacpp.py):
    weights of its blocks + KV cache of its blocks + compute buffer estimate (+ the output layer on the last
    device; + the input embedding on the coordinator's CPU) <= capacity, where a CPU worker's compute
    buffer under pipeline parallelism is what it writes, not what llama.cpp reserves (`Slot.compute_for`),
    capacity = min(free, total) minus a margin; for a unified-memory device (Apple's MTL0)
               min(free, wired limit if one is set, clamp x total) minus a margin, and on a coordinator
               its CPU and that device together within min(free, clamp x total) minus a margin
               (planning/unified_memory.py; `Problem.pool_*`).
Speed (single-stream decode is memory-bandwidth bound):
    seconds per token = the coordinator's fixed cost of a pass
                        + sum over devices of (weight bytes + KV bytes a token reads there) / its bandwidth
                          (all of a dense block's weights; of a mixture of experts' routed experts only
                          expert_used_count / expert_count, the experts a token is routed to)
                        + for every block whose experts sit on another device than the rest of the block:
                          the RPC cost of each remote device on the way there and back
                        + for every remote node in use: its RPC hop cost
                                                        + RPC_ROUND_TRIPS_PER_TOKEN x its round-trip time
                        + the coordinator's cost of pipeline parallelism, when the split turns it on.
Memory counts every expert's bytes on the device that holds them. Bandwidths, the pass cost and the hop
cost are what the calibrate job measured (calibration/job.py)
where it has; otherwise the table of known chips and the defaults below, and the plan says so.
`evaluate` prices one split; planning/waterfill.py searches for the best; planning/planner.py turns
it into a plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planning.cluster import (
    DEFAULT_HOP_MS,
    DEFAULT_PASS_OVERHEAD_MS,
    DEFAULT_PIPELINE_OVERHEAD_MS,
    DEFAULT_RTT_MS,
    KV_TYPES,
    RPC_ROUND_TRIPS_PER_TOKEN,
    Device,
    Node,
    Settings,
    validate_cluster,
)
from planning.unified_memory import (
    cpu_of_unified,
    pool_limit_bytes,
    unified_gpu,
    unified_share,
)

# With pipeline parallelism on, ggml_backend_sched (GGML_SCHED_MAX_COPIES) keeps this many copies of every
# split's inputs in each device's compute buffer, and the buffer it reserves grows to about four times a
# copy's size. A GPU allocates all of it; a CPU device allocates it with malloc, and the kernel charges only
# the pages it writes (see `Slot.lazy` and `input_copy_bytes`).
PIPELINE_COPIES = 4


def expert_fraction(profile: dict[str, Any]) -> float:
    """The share of a block's routed-expert bytes one token reads: expert_used_count of expert_count."""
    count, used = int(profile.get("expert_count") or 0), int(profile.get("expert_used_count") or 0)
    return min(1.0, used / count) if count and used else 1.0


def expert_bytes_per_block(profile: dict[str, Any]) -> list[int]:
    """Bytes of each block's routed experts (0 for a dense model, or a profile read before issue 19)."""
    experts = profile.get("block_expert_bytes")
    return [int(b) for b in experts] if experts else [0] * int(profile["block_count"])


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


# Bytes per ubatch token beyond the activations in a compute buffer (positions, token ids, row indexes, and
# the allocator's alignment), as llama.cpp's logs show them: on the coordinator's CPU, on another device.
CPU_TOKEN_BYTES = 40
DEVICE_TOKEN_BYTES = 20
# llama.cpp's default logical batch (-b): it caps the physical batch (-ub) with the context.
DEFAULT_BATCH = 2048


def reserve_ubatch(settings: Settings) -> int:
    """The tokens of the batch llama.cpp reserves its compute buffers for: -ub, capped by -b and the whole
    context (llama_context: n_batch = min(n_ctx, n_batch), n_ubatch = min(n_batch, n_ubatch))."""
    _, total = kv_cells(settings)
    return max(1, min(settings.ubatch, DEFAULT_BATCH, total))


def logits_bytes(profile: dict[str, Any], settings: Settings) -> int:
    """One f32 row of logits per output: llama-server reserves one output per slot (-np)."""
    return 4 * int(profile.get("vocab_size") or 32000) * settings.parallel


def compute_bytes(
    profile: dict[str, Any], settings: Settings, *, role: str, coordinator_cpu: bool, pipeline: bool = False
) -> int:
    """One copy of a device's compute buffer as ggml_backend_sched reserves it (llama_context's worst-case
    graph: -ub tokens, one output per slot, flash attention with its f16 mask over one sequence's cells).

    Without pipeline parallelism the figures are llama.cpp's own, read from its logs for dense llama-style
    models on its CPU and RPC backends (tests/planning/test_memory_vs_llamacpp.py holds them to 2%): per
    ubatch token, the f16 mask row plus f32 activations, whose peak is the feed-forward's three n_ff rows
    beside a few n_embd rows; a device whose blocks end in the output layer holds the larger of that and
    the logits. `role`: "mid" (blocks, no output), "out" (blocks and the output layer), "tail" (the output
    layer and the last block only, whose feed-forward runs on the output rows only), "logits" (the output
    layer alone), "idle" (the coordinator's CPU computing no block: input embeddings and the mask). The
    coordinator's CPU also holds the host copy of the logits (llama.cpp's "CPU output buffer"), counted here.
    A device other than the CPU that holds block 0 holds two rows more (`first_block_bytes`).

    With pipeline parallelism the graph is cut into more, smaller splits, so the feed-forward share is
    smaller (but there are four copies; a CPU worker only writes one of them and the copies of its inputs:
    `Slot.compute_for`); that estimate is kept above llama.cpp's reservation, within 2x.
    """
    per_seq, _ = kv_cells(settings)
    ub = reserve_ubatch(settings)
    n_embd = int(profile["embedding_length"])
    n_ff = profile.get("feed_forward_length") or 4 * n_embd
    n_ff = max(n_ff) if isinstance(n_ff, list) else int(n_ff)
    n_ff *= max(1, int(profile.get("expert_used_count") or 1))
    n_vocab = int(profile.get("vocab_size") or 32000)
    host_logits = logits_bytes(profile, settings) if coordinator_cpu else 0
    mask = 2 * per_seq
    if pipeline:
        ub = min(settings.ubatch, per_seq)
        if role == "idle":
            floats = 4 * n_embd
        elif role in ("tail", "logits"):
            floats = 5 * n_embd
        else:
            floats = n_ff + 4 * n_embd
        if role in ("out", "tail", "logits"):
            floats = max(floats, n_vocab // ub + 2 * n_embd)
        return ub * (4 * floats + mask) + host_logits
    extra = CPU_TOKEN_BYTES if coordinator_cpu else DEVICE_TOKEN_BYTES
    if role == "logits":
        return logits_bytes(profile, settings) + host_logits
    if role == "idle" or role == "tail":
        activations = ub * (4 * 4 * n_embd + extra)
    elif coordinator_cpu:
        activations = ub * (4 * (3 * n_ff + 5 * n_embd) + extra)
    else:
        activations = ub * (4 * (3 * n_ff + 2 * n_embd) + extra)
    if role in ("out", "tail"):
        activations = max(activations, logits_bytes(profile, settings))
    return activations + ub * mask + host_logits


def first_block_bytes(profile: dict[str, Any], settings: Settings) -> int:
    """What a device other than the coordinator's CPU holds more when its blocks start at block 0 (without
    pipeline parallelism): two more f32 rows per ubatch token, as llama.cpp's logs show."""
    return reserve_ubatch(settings) * 4 * 2 * int(profile["embedding_length"])


def apart_bytes(profile: dict[str, Any], settings: Settings) -> int:
    """What a device other than the coordinator's CPU holds more when it computes the experts of some of
    its blocks while others of its blocks send theirs to another device: one more f32 row per ubatch token
    (the experts' result coming back), as llama.cpp's log shows for a generated mixture of experts
    (tests/planning/test_moe_memory_vs_llamacpp.py: 8.01 MiB reserved, 7.51 counted without it)."""
    return reserve_ubatch(settings) * 4 * int(profile["embedding_length"])


def input_copy_bytes(profile: dict[str, Any], settings: Settings) -> int:
    """One copy of the inputs of a device's split at the worst-case ubatch: what pipeline parallelism adds to
    a CPU device's compute buffer per extra copy.

    What llama.cpp's scheduler lists for a split of blocks on an RPC device (GGML_SCHED_DEBUG=1, llama-server
    -lv 10): three f32 tensors of n_embd x ubatch (inp_mixed_embd, node_1, embd), the f16 attention mask over
    the cells of one sequence, and positions and indexes of a few bytes per token.
    """
    per_seq, _ = kv_cells(settings)
    ub = min(settings.ubatch, per_seq)
    n_embd = int(profile["embedding_length"])
    return ub * (3 * 4 * n_embd + 2 * per_seq + 16)


def capacity_bytes(device: Device, settings: Settings) -> tuple[int, int]:
    """(limit, capacity): the memory a device may use at all, and that minus the safety margin."""
    limit = device.free_bytes
    if device.unified:
        limit = min(limit, unified_share(device, settings.clamp)[0])
    limit = max(0, limit)
    return limit, _less_margin(limit, settings)


def _less_margin(limit: int, settings: Settings) -> int:
    return max(0, int(limit * (1 - settings.margin_fraction)))


@dataclass
class Slot:
    """One offload device as the search sees it."""

    device: Device
    node: Node
    remote: bool
    limit: int
    capacity: int
    bandwidth: float  # bytes per second
    overhead_s: float  # per-token RPC cost of its node: its hop plus the network's round trips
    # Bytes of one compute-graph copy by (role, pipeline parallelism on); see `compute_bytes`.
    compute: dict[tuple[str, bool], int] = field(default_factory=dict)
    # A CPU device of a remote node: its ggml-rpc-server allocates compute buffers with malloc, so the memory
    # it is charged for (RSS; a cgroup's limit) is the pages it writes, not the buffer llama.cpp reserves.
    lazy: bool = False
    # One copy of its split's inputs (`input_copy_bytes`).
    input_copy: int = 0
    # What its compute buffer holds more when its blocks start at block 0 (`first_block_bytes`).
    first_extra: int = 0
    # What its compute buffer holds more when it runs the experts of some blocks while other blocks of its
    # own have their experts elsewhere (`apart_bytes`).
    apart_extra: int = 0
    # The CPU of a remote node held to a CPU quota, when it is the node's only device: the quota's period
    # (seconds) and the quota in cores (see `quota_time`). 0.0: no quota to model.
    burst_s: float = 0.0
    quota_cores: float = 1.0
    # The network's round trips inside overhead_s: waiting on the wire, which no CPU quota speeds up.
    network_s: float = 0.0

    def time_with_overhead(self, seconds):
        """`seconds` of work on this device plus its node's overhead: the work and the hop under the
        node's CPU quota (`quota_time`), the network's round trips as they are."""
        return self.quota_time(seconds + self.overhead_s - self.network_s) + self.network_s

    def quota_time(self, seconds):
        """The time per token of work that takes `seconds` (its share of bytes over the measured bandwidth,
        plus its node's hop) at the steady pace a CPU quota allows, which is what calibration measures.

        A quota is granted per period: a process that waited for the others' part of the token starts its
        own with quota to spend at full speed, and on average ends about one period sooner than the steady
        pace says (it starts at a random point of a period, and its last part runs at full speed at the
        start of one). Never faster than the same work at full speed, `seconds` times the quota; with a
        quota of a core or more that floor is `seconds` itself (how many cores the work would use at full
        speed is not known), so no gain is counted. In the lab (10% of a core, 10 ms periods) one block
        moved to the throttled worker cost 7 to 10 ms a token in a deployment, where its calibrated pace
        and hop say about 24 (README, "Why the split matters"). Takes and returns numbers or arrays."""
        if not self.burst_s:
            return seconds
        return np.maximum(seconds - self.burst_s, seconds * min(1.0, self.quota_cores))

    def compute_for(self, role: str, copies: int, first: bool = False) -> int:
        """Its compute buffer in `role` with `copies` graph copies; `first`: its blocks start at block 0."""
        if copies == 1:
            return self.compute[(role, False)] + (self.first_extra if first else 0)
        if self.lazy:
            # Measured with the lab's limit_memory on a real rpc-server (the split_speed model: 8 blocks of
            # n_embd 1536 and n_ff 4096, -c 512), after prompts of 500 tokens, which write a whole ubatch:
            # beyond its weights and KV cache the worker held 47.6 MiB with the plan's 6 blocks and the
            # output layer (llama.cpp reserved 47.04, plus the CPU backend's work buffer;
            # tests/planning/test_rpc_memory_lab.py) and 54.5 MiB with 8 blocks and the output on the other
            # worker (74.05 reserved), against 32.1 MiB (30.5 reserved) without pipeline parallelism. One copy
            # of the graph and the extra copies of its inputs counts 68 MiB there; four copies of the graph
            # counted 82 MiB. The idle rpc-server itself (1.1 MiB there) is within the margin.
            return self.compute[(role, False)] + (copies - 1) * self.input_copy
        return self.compute[(role, copies > 1)] * copies


@dataclass
class Problem:
    profile: dict[str, Any]
    settings: Settings
    nodes: list[Node]
    coordinator: Node
    cpu: Slot
    slots: list[Slot]
    block_bytes: list[int]  # weights + KV of each block: what it takes in memory
    weights: list[int]
    kv: list[int]
    prefix: np.ndarray  # prefix sums of block_bytes, float64
    cpu_base: int  # input embedding and other non-block tensors, on the coordinator's CPU
    warnings: list[str] = field(default_factory=list)
    # What a token reads of each block: its dense weights, its KV and its experts' share (`expert_fraction`);
    # the same as block_bytes for a dense model. Their prefix sums; each block's routed experts, as held in
    # memory and as read per token.
    read_bytes: list[float] = field(default_factory=list)
    read_prefix: np.ndarray = field(default_factory=lambda: np.zeros(1))
    expert_bytes: list[int] = field(default_factory=list)
    expert_read: list[float] = field(default_factory=list)
    # The weights llama.cpp maps on the coordinator's CPU when it holds blocks 0..j-1, by j, without and with
    # the output layer (`cpu_weight_tables`); the KV cache of blocks 0..j-1, by j.
    cpu_weights: np.ndarray = field(default_factory=lambda: np.zeros(1))
    cpu_weights_out: np.ndarray = field(default_factory=lambda: np.zeros(1))
    kv_prefix: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # A coordinator with unified memory: the index in `slots` of its unified GPU, which shares one pool
    # with the CPU; the CPU's and that GPU's bytes together stay within `pool_capacity` (the pool's limit
    # `pool_limit` minus the margin).
    pool_slot: int | None = None
    pool_limit: int = 0
    pool_capacity: int = 0

    def pool_used(self, cpu_bytes: int, gpu_bytes: int) -> bool:
        """Whether the CPU's and the unified GPU's bytes fit their shared pool (always, without one)."""
        return self.pool_slot is None or cpu_bytes + gpu_bytes <= self.pool_capacity

    # The coordinator's fixed cost of one decode pass, paid by every split alike.
    fixed_s: float = 0.0
    # What pipeline parallelism adds per token, paid by the splits that turn it on.
    pipeline_s: float = 0.0


def tied_output_bytes(profile: dict[str, Any]) -> int:
    """The output matrix's bytes that are token_embd's own (tied embeddings; profiles read before the field
    existed: the input embedding)."""
    if "tied_output_bytes" in profile:
        return int(profile["tied_output_bytes"])
    return int(profile.get("input_embedding_bytes", 0)) if profile.get("tied_embeddings") else 0


def _mapped(ranges: dict[int, list[int]]) -> int:
    return sum(end - start for start, end in ranges.values())


def _widen(ranges: dict[int, list[int]], spans: list[list[int]]) -> None:
    for shard, start, end in spans:
        have = ranges.setdefault(int(shard), [int(start), int(end)])
        have[0], have[1] = min(have[0], int(start)), max(have[1], int(end))


def cpu_weight_tables(profile: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The weights llama.cpp holds on the coordinator's CPU with blocks 0..j-1 there, by j: (without the
    output layer, with it).

    llama.cpp maps the CPU's tensors from the file: one range per shard, from the first of them to the end
    of the last (llama_model_loader::get_mapping_range), which is what its log reports as the CPU_Mapped
    model buffer. In a file whose blocks are not in numeric order (SmolLM2's: blk.0, blk.1, blk.10, ...)
    that range covers other blocks too. With tied embeddings the output matrix is the input's token_embd,
    mapped once. Profiles read before the tensor ranges were recorded count the tensors' own bytes."""
    weights = np.array([int(b) for b in profile["block_weight_bytes"]], dtype=np.float64)
    base = int(profile.get("input_embedding_bytes", 0)) + int(profile.get("other_bytes", 0))
    output = int(profile["output_bytes"]) - tied_output_bytes(profile)
    spans = profile.get("tensor_spans")
    if not spans or len(spans.get("blocks", [])) != len(weights):
        without = np.concatenate([[0.0], np.cumsum(weights)]) + base
        return without, without + output
    tables = []
    for with_output in (False, True):
        ranges: dict[int, list[int]] = {}
        _widen(ranges, spans.get("input", []))
        _widen(ranges, spans.get("other", []))
        if with_output:
            _widen(ranges, spans.get("output", []))
        table = [_mapped(ranges)]
        for block in spans["blocks"]:
            _widen(ranges, block)
            table.append(_mapped(ranges))
        tables.append(np.array(table, dtype=np.float64))
    return tables[0], tables[1]


def cpu_mapped_bytes(
    profile: dict[str, Any], blocks: Sequence[int], expert_blocks: Sequence[int], output: bool
) -> int | None:
    """The file range llama.cpp maps for the coordinator's CPU when a mixture of experts is placed apart:
    the CPU holds the rest of `blocks` (the input, and the output layer when `output`) and the routed experts
    of `expert_blocks`. One range per shard from the first of those tensors to the end of the last, as for a
    dense model (`cpu_weight_tables`): it covers whatever lies between, such as the attention of a block
    whose experts alone are on the CPU. None for a profile read before expert spans were recorded."""
    spans = profile.get("tensor_spans") or {}
    n = int(profile["block_count"])
    if len(spans.get("block_experts", [])) != n or len(spans.get("block_dense", [])) != n:
        return None
    ranges: dict[int, list[int]] = {}
    _widen(ranges, spans.get("input", []))
    _widen(ranges, spans.get("other", []))
    if output:
        _widen(ranges, spans.get("output", []))
    for block in blocks:
        _widen(ranges, spans["block_dense"][block])
    for block in expert_blocks:
        _widen(ranges, spans["block_experts"][block])
    return _mapped(ranges)


def _compute_table(profile: dict[str, Any], settings: Settings, *, coordinator_cpu: bool) -> dict:
    return {
        (role, pp): compute_bytes(profile, settings, role=role, coordinator_cpu=coordinator_cpu, pipeline=pp)
        for role in ("mid", "out", "tail", "logits", "idle")
        for pp in (False, True)
    }


def _quota(node: Node, device: Device) -> dict[str, float]:
    """Slot fields for a node's CPU quota: only for a CPU that is its node's only device, where the quota
    covers everything the node does for a token (its hop too); a GPU's time is not the CPU's. Only for a
    measured figure: calibration measures the steady pace under the quota that this gain is taken from,
    where a table's figure knows nothing of the quota."""
    if device.kind != "cpu" or len(node.devices) != 1 or not node.cpu_quota_cores:
        return {}
    if device.bandwidth_source != "measured":
        return {}
    if not node.cpu_quota_period_ms:
        return {}
    return {"burst_s": node.cpu_quota_period_ms / 1000.0, "quota_cores": node.cpu_quota_cores}


def build_problem(profile: dict[str, Any], nodes: Sequence[Node], settings: Settings) -> Problem:
    settings.validate()
    validate_cluster(nodes)
    coordinator = next(n for n in nodes if n.coordinator)
    warnings: list[str] = []
    weights = [int(b) for b in profile["block_weight_bytes"]]
    kv = kv_bytes_per_block(profile, settings)
    block_bytes = [w + k for w, k in zip(weights, kv, strict=True)]
    prefix = np.concatenate([[0.0], np.cumsum(np.array(block_bytes, dtype=np.float64))])
    experts = expert_bytes_per_block(profile)
    if len(experts) != len(weights):
        raise ValueError("The profile's block_expert_bytes has not one entry per block.")
    fraction = expert_fraction(profile)
    expert_read = [e * fraction if e else 0.0 for e in experts]
    # A dense block is read whole: the same numbers as block_bytes, so dense models plan exactly as before.
    read_bytes = [
        float(b) - e + r if e else float(b) for b, e, r in zip(block_bytes, experts, expert_read, strict=True)
    ]
    read_prefix = np.concatenate([[0.0], np.cumsum(np.array(read_bytes, dtype=np.float64))])

    def slot(device: Device, node: Node) -> Slot:
        limit, capacity = capacity_bytes(device, settings)
        remote = not node.coordinator
        hop = (node.hop_ms if node.hop_ms is not None else DEFAULT_HOP_MS) if remote else 0.0
        bandwidth = device.bandwidth_gbs
        if not remote and device.name == "CPU" and device.local_bandwidth_gbs:
            bandwidth = device.local_bandwidth_gbs
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
            bandwidth=bandwidth * 1e9,
            overhead_s=(hop + RPC_ROUND_TRIPS_PER_TOKEN * (rtt or 0.0)) / 1000.0 if remote else 0.0,
            network_s=RPC_ROUND_TRIPS_PER_TOKEN * (rtt or 0.0) / 1000.0 if remote else 0.0,
            compute=_compute_table(profile, settings, coordinator_cpu=False),
            lazy=remote and device.kind == "cpu",
            input_copy=input_copy_bytes(profile, settings),
            first_extra=first_block_bytes(profile, settings),
            apart_extra=apart_bytes(profile, settings),
            **_quota(node, device) if remote else {},
        )

    unified = unified_gpu(coordinator)
    cpu_device = next((d for d in coordinator.devices if d.name == "CPU"), None) or cpu_of_unified(unified)
    cpu = slot(cpu_device, coordinator)
    cpu.compute = _compute_table(profile, settings, coordinator_cpu=True)
    cpu.first_extra = 0
    cpu.apart_extra = 0
    slots = [slot(d, coordinator) for d in coordinator.devices if d.name != "CPU"]
    for node in nodes:
        if not node.coordinator:
            slots += [slot(d, node) for d in node.devices]
    pool: dict[str, Any] = {}
    if unified is not None:
        # The CPU and the unified GPU draw on one memory: each keeps its own limit (the GPU's wired limit
        # is not the CPU's) and the two together stay within the pool, so nothing is counted twice.
        pool_limit = pool_limit_bytes(unified, settings.clamp)
        cpu.limit = min(cpu.limit, pool_limit)
        cpu.capacity = _less_margin(cpu.limit, settings)
        pool = {
            "pool_slot": next(i for i, s in enumerate(slots) if s.device is unified),
            "pool_limit": pool_limit,
            "pool_capacity": _less_margin(pool_limit, settings),
        }
    cpu_base = int(profile.get("input_embedding_bytes", 0)) + int(profile.get("other_bytes", 0))
    cpu_weights, cpu_weights_out = cpu_weight_tables(profile)
    kv_prefix = np.concatenate([[0.0], np.cumsum(np.array(kv, dtype=np.float64))])
    pass_ms = coordinator.pass_overhead_ms
    fixed_s = (pass_ms if pass_ms is not None else DEFAULT_PASS_OVERHEAD_MS) / 1000.0
    pipeline_ms = coordinator.pipeline_overhead_ms
    pipeline_s = (pipeline_ms if pipeline_ms is not None else DEFAULT_PIPELINE_OVERHEAD_MS) / 1000.0
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
        fixed_s=fixed_s,
        pipeline_s=pipeline_s,
        read_bytes=read_bytes,
        read_prefix=read_prefix,
        expert_bytes=experts,
        expert_read=expert_read,
        cpu_weights=cpu_weights,
        cpu_weights_out=cpu_weights_out,
        kv_prefix=kv_prefix,
        **pool,
    )


@dataclass
class Split:
    """cpu_blocks first blocks on the coordinator's CPU, then `counts[i]` blocks on `order[i]` (slot index);
    the output layer on the last entry of `order`, or on the CPU when `order` is empty.

    `experts`, for a mixture of experts placed apart: for every block, where its routed experts are
    (EXPERTS_ON_CPU for the coordinator's CPU, else a slot index), given to llama.cpp as `-ot` rules. None:
    they stay with their block, and no rule is given."""

    cpu_blocks: int
    order: list[int]
    counts: list[int]
    experts: list[int] | None = None


EXPERTS_ON_CPU = -1


@dataclass(frozen=True)
class Part:
    """One device's share of a split: its blocks and what they hold there, in bytes."""

    slot: Slot
    first_block: int
    blocks: int
    weights: int
    kv: int
    compute: int
    holds_output: bool
    # The blocks whose routed experts it holds, when the split places experts (`Split.experts`).
    expert_blocks: tuple[int, ...] = ()

    @property
    def used_bytes(self) -> int:
        return self.weights + self.kv + self.compute


@dataclass
class Evaluation:
    fits: bool
    seconds_per_token: float
    # One entry per device of the split, the coordinator's CPU first, then the devices of `order`, then those
    # that hold only experts (in slot order).
    parts: list[Part]


def pipeline_parallel(split: Split) -> bool:
    """llama.cpp turns on pipeline parallelism (four copies of the inputs in every compute buffer) when all
    layers go to more than one device, and no tensor override (`-ot`) is given (llama_context's
    `!model.has_tensor_overrides()`)."""
    return split.cpu_blocks == 0 and len(split.order) > 1 and split.experts is None


def _role(is_cpu: bool, start: int, count: int, output: bool, n: int, hosts_more: bool = False) -> str:
    if is_cpu:
        return "out" if output else ("idle" if count == 0 and not hosts_more else "mid")
    if output:
        if count == 0 and not hosts_more:
            return "logits"
        return "tail" if count == 1 and start + count == n and not hosts_more else "out"
    return "mid"


def excursion_s(slot: Slot) -> float:
    """What a block whose experts are apart pays per token for one device on its way (the experts' device,
    or the device of the rest of the block it comes back to): a remote one's RPC cost (its hop and round
    trips: the inputs set, the graph run, the result read back), nothing for a local one."""
    return slot.overhead_s if slot.remote else 0.0


def evaluate(problem: Problem, split: Split) -> Evaluation:
    n = len(problem.block_bytes)
    if split.cpu_blocks + sum(split.counts) != n or len(split.order) != len(split.counts):
        raise ValueError("The split does not place every block exactly once.")
    if split.experts is not None and (
        len(split.experts) != n or any(not EXPERTS_ON_CPU <= x < len(problem.slots) for x in split.experts)
    ):
        raise ValueError("The split does not place every block's experts exactly once.")
    copies = PIPELINE_COPIES if pipeline_parallel(split) else 1
    out_bytes = int(problem.profile["output_bytes"])
    parts = []
    seconds = 0.0
    fits = True
    # (key, slot, blocks, holds the output layer); key: EXPERTS_ON_CPU or the slot index
    entries = [(EXPERTS_ON_CPU, problem.cpu, split.cpu_blocks, not split.order)]
    entries += [
        (i, problem.slots[i], c, k == len(split.order) - 1)
        for k, (i, c) in enumerate(zip(split.order, split.counts, strict=True))
    ]
    home = [key for key, _, count, _ in entries for _ in range(count)]
    experts = split.experts if split.experts is not None else home
    hosted: dict[int, list[int]] = {}
    for block, key in enumerate(experts):
        hosted.setdefault(key, []).append(block)
    chain = {key for key, *_ in entries}
    entries += [(i, problem.slots[i], 0, False) for i in sorted(hosted) if i not in chain]
    ex, ex_read = problem.expert_bytes, problem.expert_read
    start = 0
    seconds += problem.fixed_s + (problem.pipeline_s if copies > 1 else 0.0)
    used_nodes: set[str] = set()
    for key, slot, count, output in entries:
        own = range(start, start + count)
        holds = hosted.get(key, [])
        # The block's dense part where the block is, the experts where they are placed.
        weights = sum(problem.weights[b] - ex[b] for b in own) + sum(ex[b] for b in holds)
        weights += out_bytes if output else 0
        if slot is problem.cpu:
            # The file range llama.cpp maps for the CPU's blocks, less the experts placed elsewhere, plus
            # the experts of other blocks placed here (both zero for a dense model).
            weights = int((problem.cpu_weights_out if output else problem.cpu_weights)[count])
            weights += sum(ex[b] for b in holds if b not in own) - sum(ex[b] for b in own if b not in holds)
            if split.experts is not None:
                mapped = cpu_mapped_bytes(problem.profile, own, holds, output)
                weights = weights if mapped is None else mapped
        kv = sum(problem.kv[start : start + count])
        hosts_more = any(not start <= b < start + count for b in holds)
        role = _role(slot is problem.cpu, start, count, output, n, hosts_more)
        compute = slot.compute_for(role, copies, first=start == 0 and count > 0)
        if holds and any(ex[b] and experts[b] != key for b in own):
            compute += slot.apart_extra
        fits = fits and weights + kv + compute <= slot.capacity
        read = sum(problem.read_bytes[b] - ex_read[b] for b in own) + sum(ex_read[b] for b in holds)
        work = (read + (out_bytes if output else 0)) / slot.bandwidth
        if slot.remote and slot.node.name not in used_nodes and (count or output):
            used_nodes.add(slot.node.name)
            seconds += slot.time_with_overhead(work)
        else:
            seconds += slot.quota_time(work)
        placed = tuple(holds) if split.experts is not None else ()
        parts.append(Part(slot, start, count, weights, kv, compute, output, placed))
        start += count
    for block, key in enumerate(experts):
        if key != home[block]:
            seconds += excursion_s(_slot_of(problem, key)) + excursion_s(_slot_of(problem, home[block]))
    if problem.pool_slot is not None:
        used = {id(p.slot): p.used_bytes for p in parts}
        fits = fits and problem.pool_used(
            used[id(problem.cpu)], used.get(id(problem.slots[problem.pool_slot]), 0)
        )
    return Evaluation(fits, seconds, parts)


def _slot_of(problem: Problem, key: int) -> Slot:
    return problem.cpu if key == EXPERTS_ON_CPU else problem.slots[key]
