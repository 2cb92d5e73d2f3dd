"""Mixture-of-experts planning (issue 19): a token reads the dense part of every block and only its share of
the experts; the planner may place a block's experts on another device than the rest of the block, and its
choice is the exact optimum of the model (checked against exhaustive search)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planning import planner
from planning.planner import GIB, MIB, Device, Node, Settings
from tests.planning.profiles import make_moe_profile, make_profile


def cpu_only(gib: float = 64.0, bw: float = 20.0) -> list[Node]:
    device = Device("desk", "CPU", "cpu", int(gib * GIB), int(gib * GIB), bw, bandwidth_source="measured")
    return [Node("desk", "127.0.0.1", (device,), coordinator=True, pass_overhead_ms=1.0)]


def test_a_token_reads_the_dense_bytes_and_its_share_of_the_experts():
    profile = make_moe_profile(n_layer=4, dense_mib=20.0, expert_mib=160.0, output_mib=50.0)
    result = planner.plan(profile, cpu_only(), Settings(ctx=512))
    (cpu,) = result["placements"]
    kv = cpu["kv_bytes"]
    # Two of eight experts: a quarter of the 160 MiB per block.
    read = 4 * (20 + 160 / 4) * MIB + kv + 50 * MIB
    assert 1 / result["predicted_tokens_per_s"] == pytest.approx(0.001 + read / 20e9, rel=1e-3)
    # Memory holds every expert.
    assert cpu["weights_bytes"] == 4 * 180 * MIB + 50 * MIB + profile["input_embedding_bytes"]


def test_the_same_bytes_as_a_dense_model_plan_four_times_faster_when_a_quarter_is_read():
    moe = make_moe_profile(n_layer=4, dense_mib=0.0, expert_mib=400.0, output_mib=0.0, experts=(8, 2))
    dense = make_profile(n_layer=4, block_mib=400.0, output_mib=0.0)
    moe_s = planner.search(planner.build_problem(moe, cpu_only(), Settings(ctx=256)))[1] - 0.001
    dense_s = planner.search(planner.build_problem(dense, cpu_only(), Settings(ctx=256)))[1] - 0.001
    kv_s = 4 * planner.kv_bytes_per_block(dense, Settings(ctx=256))[0] / 20e9
    assert moe_s - kv_s == pytest.approx((dense_s - kv_s) / 4, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Exhaustive search over every placement of blocks and of their experts


def dense_splits(problem: planner.Problem):
    """Every split llama.cpp's -ngl/-ts can express (device subsets, orders, whole-block counts)."""
    n = len(problem.block_bytes)
    slots = range(len(problem.slots))
    for size in range(len(problem.slots) + 1):
        for order in itertools.permutations(slots, size):
            for cpu_blocks in range(n + 1):
                rest = n - cpu_blocks
                if not order:
                    if not rest:
                        yield cpu_blocks, [], []
                    continue
                for c in itertools.product(range(1, rest + 1), repeat=size - 1):
                    if sum(c) <= rest:
                        yield cpu_blocks, list(order), [*c, rest - sum(c)]


def exhaustive(problem: planner.Problem) -> float:
    """The least predicted time over every split, each with its experts left with their blocks or placed
    anywhere (the coordinator's CPU or any device, block by block)."""
    n = len(problem.block_bytes)
    best = math.inf
    keys = [planner.EXPERTS_ON_CPU, *range(len(problem.slots))]
    for cpu_blocks, order, counts in dense_splits(problem):
        for experts in [None, *map(list, itertools.product(keys, repeat=n))]:
            ev = planner.evaluate(problem, planner.Split(cpu_blocks, order, counts, experts))
            if ev.fits:
                best = min(best, ev.seconds_per_token)
    return best


def device(node: str, name: str, gib: float, bw: float, kind: str = "cpu") -> Device:
    return Device(node, name, kind, int(gib * GIB), int(gib * GIB), bw, bandwidth_source="measured")


@st.composite
def moe_instances(draw):
    """Up to four blocks with experts, two or three devices (the coordinator's CPU included), some of them
    remote, with or without a CPU quota, capacities from nothing to the whole model."""
    n_layer = draw(st.integers(1, 4))
    dense_mib = draw(st.sampled_from([10.0, 50.0, 200.0]))
    expert_mib = draw(st.sampled_from([100.0, 400.0, 1000.0]))
    profile = make_moe_profile(
        n_layer,
        dense_mib,
        expert_mib,
        output_mib=draw(st.sampled_from([20.0, 300.0])),
        experts=draw(st.sampled_from([(8, 2), (4, 1), (2, 2)])),
    )
    unit = (dense_mib + expert_mib) / 1024
    bandwidths = st.sampled_from([10.0, 40.0, 100.0, 400.0, 900.0])

    def capacity() -> float:
        return unit * draw(st.floats(0.0, n_layer + 1.5)) + 0.3

    coordinator = [device("desk", "CPU", capacity() + unit * 0.5, draw(bandwidths))]
    count = 1 + draw(st.integers(1, 2))
    if draw(st.booleans()):
        coordinator.append(device("desk", "CUDA0", capacity(), draw(bandwidths), kind="cuda"))
    nodes = [Node("desk", "10.0.0.1", tuple(coordinator), coordinator=True, pass_overhead_ms=1.0)]
    left = count - len(coordinator)
    r = 0
    while left > 0:
        name = f"r{r}"
        devices = [device(name, "CPU", capacity(), draw(bandwidths))]
        if left > 1 and draw(st.booleans()):
            devices.append(device(name, "Vulkan0", capacity(), draw(bandwidths), kind="vulkan"))
        left -= len(devices)
        quota = draw(st.sampled_from([None, None, (0.1, 10.0)])) if len(devices) == 1 else None
        fields = {"cpu_quota_cores": quota[0], "cpu_quota_period_ms": quota[1]} if quota else {}
        rtt = draw(st.sampled_from([0.1, 1.0, 10.0]))
        nodes.append(Node(name, f"10.0.0.{r + 2}", tuple(devices), rtt_ms=rtt, hop_ms=0.5, **fields))
        r += 1
    return profile, nodes, Settings(ctx=draw(st.sampled_from([256, 2048])), margin_fraction=0.0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_instances())
def test_the_planner_places_experts_at_the_exact_optimum_of_exhaustive_search(instance):
    profile, nodes, cfg = instance
    problem = planner.build_problem(profile, nodes, cfg)
    assert len(problem.slots) + 1 <= 3
    split, seconds = planner.search(problem)
    brute = exhaustive(problem)
    if brute == math.inf:
        assert split is None
        return
    assert split is not None
    assert seconds == pytest.approx(brute, rel=1e-9)
    ev = planner.evaluate(problem, split)
    assert ev.fits and ev.seconds_per_token == pytest.approx(seconds, rel=1e-9)
