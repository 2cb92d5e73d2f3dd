"""The first token and the load time a split is predicted to take (planning/first_word.py), by hand."""

from __future__ import annotations

import pytest

from planning.cluster import Settings, cluster_from_dict
from planning.costs import Split, build_problem
from planning.first_word import block_flops, predict_load, predict_ttft, stage_seconds, ubatches
from planning.planner import plan

MB = 1_000_000


def _profile(n_layer: int = 2) -> dict:
    """Round numbers: n_embd 1000, 10 heads of 100, n_ff 1000, 1000 tokens; 20 MB a block."""
    return {
        "architecture": "llama",
        "block_count": n_layer,
        "context_length": 4096,
        "embedding_length": 1000,
        "feed_forward_length": 1000,
        "head_count": [10] * n_layer,
        "head_count_kv": [10] * n_layer,
        "key_length": [100] * n_layer,
        "value_length": [100] * n_layer,
        "vocab_size": 1000,
        "block_weight_bytes": [20 * MB] * n_layer,
        "output_bytes": 4 * MB,
        "input_embedding_bytes": 2 * MB,
        "other_bytes": 0,
        "block_small_bytes": [2 * MB] * n_layer,
        "block_large_tensors": [3] * n_layer,
        "output_small_bytes": 4 * MB,
        "output_large_tensors": 0,
    }


def _node(name: str, *, coordinator=False, gflops=100.0, bandwidth=20.0, **extra) -> dict:
    device = {"name": "CPU", "kind": "cpu", "total_mib": 8192, "bandwidth_gbs": bandwidth}
    device["prompt_gflops"] = gflops
    return {"name": name, "coordinator": coordinator, "devices": [device], "rtt_ms": 1.0, "hop_ms": 0.5,
            "pass_overhead_ms": 1.0, "link_mbs": 100.0, **extra}  # fmt: skip


def _problem(nodes, n_layer=2, ctx=4096):
    return build_problem(_profile(n_layer), cluster_from_dict({"nodes": nodes}), Settings(ctx=ctx))


def test_a_block_costs_twice_its_parameters_per_token_and_its_attention_per_position():
    matrices, attention = block_flops(_profile())
    # q, k, v, o: 4 x 1000 x 1000; feed-forward 3 x 1000 x 1000: 7 M parameters.
    assert matrices == [14e6, 14e6]
    assert attention == [2 * 10 * 200] * 2


def test_the_prompt_is_cut_into_batches_of_ubatches():
    assert ubatches(2000, 512) == [[(0, 512), (512, 512), (1024, 512), (1536, 464)]]
    assert ubatches(3000, 1024) == [[(0, 1024), (1024, 1024)], [(2048, 952)]]


def test_the_first_token_through_one_worker_is_its_work_its_hops_and_the_activations_sent_to_it():
    problem = _problem([_node("a", coordinator=True), _node("b")])
    split = Split(0, [0], [2])
    # The coordinator: no block, its pass (1 ms). The worker: 2 blocks of 14 MFLOP a token for 512 tokens,
    # their attention over 512 x 513 / 2 positions, the output layer for the last token (2 MFLOP), at 100
    # GFLOP/s; its hop (0.5 ms) and three round trips (1 ms each); 512 x 1000 x 4 bytes in at 100 MB/s.
    work = (2 * 14e6 * 512 + 2 * 4000 * 512 * 513 / 2 + 2e6) / 100e9
    expected = 0.001 + work + 0.0005 + 0.003 + 512 * 1000 * 4 / 100e6
    assert predict_ttft(problem, split, 512) == pytest.approx(expected)
    assert expected == pytest.approx(0.17886624)


def test_with_pipeline_parallelism_the_ubatches_overlap_across_the_workers():
    problem = _problem([_node("a", coordinator=True), _node("b"), _node("c")])
    split = Split(0, [0, 1], [1, 1])
    rows = [stage_seconds(problem, split, 0, 512, last_ubatch=False)]
    rows.append(stage_seconds(problem, split, 512, 512, last_ubatch=True))
    (a1, b1, c1), (a2, b2, c2) = rows
    # A flow shop: each stage starts a ubatch when it is done with the previous one and the stage before
    # it is done with this one.
    b_done = [a1 + b1, max(a1 + a2, a1 + b1) + b2]
    c_done1 = b_done[0] + c1
    expected = max(c_done1, b_done[1]) + c2
    assert predict_ttft(problem, split, 1024) == pytest.approx(expected)
    assert expected < sum(rows[0]) + sum(rows[1])
    # The middle worker sends its activations on to the next node: in and out at 100 MB/s.
    assert b1 - c1 > 512 * 1000 * 4 / 100e6 * 0.99


def test_the_load_sends_every_worker_byte_cold_and_only_the_small_tensors_warm():
    problem = _problem([_node("a", coordinator=True), _node("b")])
    load = predict_load(problem, Split(0, [0], [2]))
    # Cold: llama-server's start (0.3 s), the coordinator's 2 MB from disk at 500 MB/s, its hashing of the
    # worker's 36 MB of large tensors at 700 MB/s, the worker's 44 MB over its 100 MB/s link. Warm: the same
    # start and hashing, 8 MB of small tensors over the link, six hashes' round trips at 1 ms, and the
    # worker's 36 MB of cached tensors from its disk at 500 MB/s.
    assert load["cold_s"] == pytest.approx(0.3 + 0.004 + 36 / 700 + 0.44, abs=1e-3)
    assert load["warm_s"] == pytest.approx(0.3 + 0.004 + 36 / 700 + 0.08 + 0.006 + 0.072, abs=1e-3)
    assert (load["worker_bytes"], load["warm_worker_bytes"], load["local_bytes"]) == (44 * MB, 8 * MB, 2 * MB)


def test_a_profile_without_tensor_sizes_has_no_warm_prediction():
    profile = _profile()
    del profile["block_small_bytes"]
    nodes = cluster_from_dict({"nodes": [_node("a", coordinator=True), _node("b")]})
    load = predict_load(build_problem(profile, nodes, Settings()), Split(0, [0], [2]))
    assert load["warm_s"] is None and load["cold_s"] == pytest.approx(0.3 + 0.004 + 0.44, abs=1e-3)


def test_the_plan_offers_the_split_best_for_long_prompts_when_it_is_not_the_decode_split():
    # The worker reads memory fast but computes slowly; the coordinator the other way round.
    nodes = [
        _node("a", coordinator=True, gflops=1000.0, bandwidth=2.0),
        _node("b", gflops=10.0, bandwidth=200.0),
    ]
    cluster = cluster_from_dict({"nodes": nodes})
    decode = plan(_profile(8), cluster, Settings(ctx=4096))
    assert [p["node"] for p in decode["placements"] if p["layers"]] == ["b"]
    option = decode["prompt_option"]
    assert option is not None
    assert option["first_word"]["ttft_s"] < decode["first_word"]["ttft_s"] * 0.9
    assert option["predicted_tokens_per_s"] < decode["predicted_tokens_per_s"]
    prompt = plan(_profile(8), cluster, Settings(ctx=4096), objective="prompt")
    assert prompt["placements"] == option["placements"]
    assert prompt["decode_option"]["predicted_tokens_per_s"] == decode["predicted_tokens_per_s"]
    assert decode["baseline"]["first_word"]["ttft_s"] > 0


def test_no_option_is_offered_when_the_decode_split_is_also_best_for_prompts():
    nodes = [_node("a", coordinator=True, bandwidth=2.0), _node("b", bandwidth=200.0, gflops=1000.0)]
    cluster = cluster_from_dict({"nodes": nodes})
    result = plan(_profile(8), cluster, Settings(ctx=4096))
    assert result["prompt_option"] is None
    assert result["first_word"]["load"]["cold_s"] > 1.0


def test_two_workers_in_a_pipeline_are_offered_for_long_prompts_when_decode_keeps_to_one():
    # Equal workers: decode saves a hop by keeping to one; a long prompt's ubatches overlap on both. The
    # coordinator is too slow to be worth a block.
    coordinator = _node("a", coordinator=True, gflops=5.0, bandwidth=1.0)
    cluster = cluster_from_dict({"nodes": [coordinator, _node("b"), _node("c")]})
    result = plan(_profile(4), cluster, Settings(ctx=2048))
    assert [p["node"] for p in result["placements"] if p["layers"]] == ["b"]
    option = result["prompt_option"]
    assert [p["node"] for p in option["placements"] if p["layers"]] == ["b", "c"]
    assert option["first_word"]["ttft_s"] < result["first_word"]["ttft_s"] * 0.9


def _twin_workers(**link) -> list:
    """Two equal workers (4 ms a block) and a coordinator too slow to be worth a block."""
    workers = [_node(name, bandwidth=5.0, **link) for name in ("b", "c")]
    return cluster_from_dict({"nodes": [_node("a", coordinator=True, gflops=5.0, bandwidth=1.0), *workers]})


def test_a_split_that_decodes_alike_and_answers_a_long_prompt_much_sooner_is_the_plan():
    # An extra hop costs 1% of a 60 ms token: under DECODE_TIE. Both workers overlap a long prompt's
    # ubatches, so its first token comes far sooner.
    nodes = _twin_workers(rtt_ms=0.05, hop_ms=0.01)
    fastest = plan(_profile(8), nodes, Settings(ctx=4096), objective="fastest")
    assert [p["node"] for p in fastest["placements"] if p["layers"]] == ["b"]
    result = plan(_profile(8), nodes, Settings(ctx=4096))
    assert [p["node"] for p in result["placements"] if p["layers"]] == ["b", "c"]
    assert result["prompt_option"] is None
    tie = result["decode_option"]
    assert tie["predicted_tokens_per_s"] == fastest["predicted_tokens_per_s"]
    assert result["predicted_tokens_per_s"] >= fastest["predicted_tokens_per_s"] * (1 - 0.03)
    assert result["first_word"]["ttft_s"] < fastest["first_word"]["ttft_s"] * 0.9
    assert result["predicted_tokens_per_s"] >= result["baseline"]["predicted_tokens_per_s"]
    # The fastest decode alone offers the long-prompt split as before.
    assert fastest["prompt_option"]["placements"] == result["placements"]


def test_a_split_that_decodes_noticeably_slower_stays_an_option():
    # Round trips of 1 ms: the extra hop costs 5% of a token, past DECODE_TIE.
    nodes = _twin_workers(rtt_ms=1.0, hop_ms=0.5)
    result = plan(_profile(8), nodes, Settings(ctx=4096))
    assert [p["node"] for p in result["placements"] if p["layers"]] == ["b"]
    assert result["prompt_option"] is not None and result.get("decode_option") is None
