"""A split given by hand (issue 19): per-device counts become the planner's own Split, priced and checked by
its own model, so the planner's split stated by hand predicts exactly what the planner predicted."""

from __future__ import annotations

import pytest

from planning import manual, planner
from planning.planner import EXPERTS_ON_CPU, Settings
from tests.planning.profiles import make_moe_profile, make_profile
from tests.planning.test_moe import gpu_desk_and_big_worker


def _counts(result: dict, devices: list[manual.ManualDevice], problem: planner.Problem) -> tuple[list, list]:
    """The planner's placements as per-device counts, as the plan page starts the form."""
    by = {(p["node"], p["device"]): p for p in result["placements"]}
    moe = [bool(e) for e in problem.expert_bytes]
    apart = any(p["expert_blocks"] for p in result["placements"])
    layers, experts = [], []
    for d in devices:
        p = by.get((d.node, d.device), {"layers": 0, "first_layer": 0, "expert_blocks": []})
        layers.append(p["layers"])
        held = p["expert_blocks"] if apart else range(p["first_layer"], p["first_layer"] + p["layers"])
        experts.append(sum(1 for b in held if moe[b]))
    return layers, experts


def test_the_planners_moe_split_stated_as_counts_is_the_same_split_and_prediction():
    profile = make_moe_profile(n_layer=8, dense_mib=20.0, expert_mib=400.0, output_mib=50.0)
    nodes, settings = gpu_desk_and_big_worker(), Settings(ctx=512)
    result = planner.plan(profile, nodes, settings)
    assert result["places_experts"]
    problem = planner.build_problem(profile, nodes, settings)
    devices = manual.manual_devices(problem, [(p["node"], p["device"]) for p in result["placements"]])
    assert [d.label for d in devices] == ["desk / CPU", "desk / CUDA0", "big / CPU"]
    layers, experts = _counts(result, devices, problem)
    assert manual.count_errors(problem, layers, experts) == []
    split = manual.manual_split(problem, devices, layers, experts)
    by_hand = planner.plan(profile, nodes, settings, split=split)
    assert by_hand["placed_by_hand"] and by_hand["fits"]
    assert by_hand["predicted_tokens_per_s"] == result["predicted_tokens_per_s"]
    assert by_hand["planner_tokens_per_s"] == result["predicted_tokens_per_s"]
    assert by_hand["llama_server_args"] == result["llama_server_args"]


def test_experts_counted_with_their_own_blocks_give_a_split_without_override_rules():
    profile = make_moe_profile(n_layer=8, dense_mib=20.0, expert_mib=40.0, output_mib=50.0)
    nodes, settings = gpu_desk_and_big_worker(), Settings(ctx=512)
    problem = planner.build_problem(profile, nodes, settings)
    devices = manual.manual_devices(problem)
    split = manual.manual_split(problem, devices, [2, 3, 3], [2, 3, 3])
    assert (split.cpu_blocks, split.order, split.counts, split.experts) == (2, [0, 1], [3, 3], None)
    assert "-ot" not in planner.plan(profile, nodes, settings, split=split)["llama_server_args"]
    # All experts on the big worker, the blocks where they were: -ot rules name its RPC buffer.
    apart = manual.manual_split(problem, devices, [2, 3, 3], [0, 0, 8])
    assert apart.experts == [1] * 8
    args = planner.plan(profile, nodes, settings, split=apart)["llama_server_args"]
    assert any(a.endswith("=RPC0[10.77.1.2:50052]") for a in args)


def test_counts_past_the_model_or_short_of_it_say_by_how_much():
    profile = make_profile(n_layer=8, block_mib=10.0, output_mib=10.0)
    nodes = gpu_desk_and_big_worker()
    problem = planner.build_problem(profile, nodes, Settings(ctx=512))
    (error,) = manual.count_errors(problem, [0, 9, 0])
    assert (error.index, error.count) == (1, "layers") and "The model has 8 blocks: no device can hold 9" in (
        error.message
    )
    (error,) = manual.count_errors(problem, [2, 4, 4])
    assert error.index == 2 and "That makes 10 blocks, 2 more than the model has (8)" in error.message
    (error,) = manual.count_errors(problem, [2, 3, 0])
    assert error.index is None and "3 of the model's 8 blocks are on no device yet" in error.message


def test_a_device_over_its_memory_is_named_with_its_need_and_its_free_memory():
    profile = make_profile(n_layer=8, block_mib=300.0, output_mib=50.0)
    nodes = gpu_desk_and_big_worker()
    problem = planner.build_problem(profile, nodes, Settings(ctx=512))
    devices = manual.manual_devices(problem)
    split = manual.manual_split(problem, devices, [0, 8, 0])
    _, needs = manual.device_needs(problem, devices, split)
    gpu = needs[1]
    assert not gpu.fits and needs[0].fits and needs[2].used_bytes == 0
    message = manual.over_memory_message(gpu)
    assert message.startswith("desk / CUDA0 would need 2.") and "but has 2.00 GiB free" in message
    assert devices[0].key == EXPERTS_ON_CPU


def test_a_split_by_hand_that_does_not_fit_is_a_plan_that_does_not_fit():
    profile = make_profile(n_layer=8, block_mib=400.0, output_mib=50.0)
    nodes = gpu_desk_and_big_worker()
    problem = planner.build_problem(profile, nodes, Settings(ctx=512))
    split = manual.manual_split(problem, manual.manual_devices(problem), [8, 0, 0])
    result = planner.plan(profile, nodes, Settings(ctx=512), split=split)
    assert not result["fits"] and "This split does not fit the devices' memory." in result["warnings"]
    with pytest.raises(ValueError):
        manual.manual_split(problem, manual.manual_devices(problem), [8, 0])
