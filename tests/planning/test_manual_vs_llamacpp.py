"""A split by hand, run by real llama.cpp (issue 19): the counts an operator gives become llama-server's
arguments through the planner's own assembly, and llama.cpp puts exactly those blocks (and, for a mixture of
experts, those experts) on each device, with the memory the form checked them against.

Real ggml-rpc-servers on 127.0.0.1 and llama-server with exactly the split's arguments, as in
tests/planning/test_planner_vs_llamacpp.py, whose helpers this uses."""

from __future__ import annotations

import json

import pytest

from llamacpp import gguf as gguf_profile
from llamacpp.logs import placement_key
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from planning import manual, planner
from tests.llamacpp_build import require_llamacpp
from tests.planning.test_planner_vs_llamacpp import (
    Processes,
    close,
    make_cluster,
    run_llama_server,
    start_rpc_servers,
)

pytestmark = pytest.mark.llamacpp


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture(scope="module")
def binaries():
    return require_llamacpp()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {
        "gqa": write_tiny_llama(root / "gqa.gguf", TinyLlama(n_head_kv=2)),
        "moe": write_tiny_llama(root / "moe.gguf", TinyLlama(n_layer=4, n_expert=8, n_expert_used=2)),
    }


def by_hand(model, nodes, settings, layers, experts=None) -> dict:
    profile = gguf_profile.profile_path(model)
    problem = planner.build_problem(profile, nodes, settings)
    devices = manual.manual_devices(problem)
    assert manual.count_errors(problem, layers, experts) == []
    split = manual.manual_split(problem, devices, layers, experts)
    _, needs = manual.device_needs(problem, devices, split)
    assert all(n.fits for n in needs), [manual.over_memory_message(n) for n in needs if not n.fits]
    plan = planner.plan(profile, nodes, settings, split=split, problem=problem)
    assert plan["fits"] and plan["placed_by_hand"]
    return plan


def test_a_dense_split_by_hand_lands_block_for_block_where_it_was_asked(binaries, processes, models):
    # Room for everything everywhere: the planner would choose otherwise; the split by hand is 2, 1, 5.
    nodes, _ = make_cluster((64, 5), [(64, 100), (64, 50)])
    settings = planner.Settings(ctx=1024, margin_fraction=0)
    plan = by_hand(models["gqa"], nodes, settings, [2, 1, 5])
    assert [(p["node"], p["layers"]) for p in plan["placements"]] == [("desk", 2), ("w1", 1), ("w2", 5)]
    start_rpc_servers(binaries, processes, plan)
    logged = run_llama_server(binaries, processes, models["gqa"], plan)
    report = json.dumps({"plan": plan["placements"], "log": logged}, indent=1)
    assert logged["offloaded"] == [7, 9], report  # w1's block, w2's five and the output layer
    block = gguf_profile.profile_path(models["gqa"])["block_weight_bytes"][0]
    for p in plan["placements"]:
        got = logged["devices"][placement_key(p)]
        assert close(got["kv"], p["kv_bytes"]), (p["node"], got, report)
        if p["llama_device"] == "CPU":
            # llama.cpp may repack some of its CPU's weights into buffers of its own (AMX, AVX2 and others),
            # which the plan's mapped-range model does not size: its KV cache is what tells its blocks.
            continue
        assert close(got["model"], p["weights_bytes"]), (p["node"], got, report)
        fixed = p["weights_bytes"] - p["layers"] * block
        assert round((got["model"] - fixed) / block) == p["layers"], report


def test_experts_placed_by_hand_on_another_worker_land_there(binaries, processes, models):
    # Every block on the first worker, every block's experts on the second: -ot rules with its RPC buffer.
    nodes, _ = make_cluster((64, 5), [(64, 100), (64, 50)])
    settings = planner.Settings(ctx=512, margin_fraction=0)
    plan = by_hand(models["moe"], nodes, settings, [0, 4, 0], [0, 0, 4])
    assert any(a == "-ot" for a in plan["llama_server_args"])
    start_rpc_servers(binaries, processes, plan)
    logged = run_llama_server(binaries, processes, models["moe"], plan)
    report = json.dumps({"plan": plan["placements"], "log": logged}, indent=1)
    by_node = {p["node"]: p for p in plan["placements"]}
    assert by_node["w2"]["expert_blocks"] == [0, 1, 2, 3] and by_node["w1"]["layers"] == 4
    for p in plan["placements"]:
        if p["llama_device"] == "CPU":
            continue
        got = logged["devices"][placement_key(p)]
        assert close(got["model"], p["weights_bytes"]), (p["node"], got, report)
        assert close(got["kv"], p["kv_bytes"]), (p["node"], got, report)
    experts = gguf_profile.profile_path(models["moe"])["block_expert_bytes"][0]
    assert logged["devices"][placement_key(by_node["w1"])]["model"] < experts, report
    assert logged["devices"][placement_key(by_node["w2"])]["model"] >= 4 * experts, report
