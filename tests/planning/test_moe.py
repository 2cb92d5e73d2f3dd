"""Mixture-of-experts planning (issue 19): a token reads the dense part of every block and only its share of
the experts; the planner may place a block's experts on another device than the rest of the block, and its
choice is the exact optimum of the model (checked against exhaustive search)."""

from __future__ import annotations

import pytest

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
