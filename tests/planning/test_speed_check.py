"""The measure step's comparison (planning/speed_check.py): the prediction at the context a measurement
filled, the node's CPU use while it decoded, and the cause a miss names."""

from __future__ import annotations

import pytest

from planning import planner
from planning.speed_check import cpu_use, filled_context, miss_causes, parse_proc, predicted_at
from tests.planning.test_speed_model import cpu, profile

PLAN = {"predicted_tokens_per_s": 10.0, "predicted_tokens_per_s_empty": 20.0, "kv_cells": 4096}


def test_the_prediction_at_a_context_lies_between_the_empty_and_the_full_one_in_seconds_per_token():
    assert predicted_at(PLAN, 0) == (pytest.approx(20.0), True)
    assert predicted_at(PLAN, 4096) == (pytest.approx(10.0), True)
    assert predicted_at(PLAN, 2048) == (pytest.approx(1 / (0.05 + 0.025)), True)
    assert predicted_at(PLAN, 10**6)[0] == pytest.approx(10.0)  # never beyond the full context


def test_a_plan_without_the_empty_figure_is_compared_at_its_full_context_and_says_so():
    assert predicted_at({"predicted_tokens_per_s": 10.0}, 100) == (10.0, False)
    assert predicted_at({"predicted_tokens_per_s": None}, 100) == (None, False)
    assert predicted_at(PLAN, None) == (10.0, False)


def test_a_measurements_tokens_read_the_prompt_and_half_of_what_they_decode_on_average():
    assert filled_context(20, 128) == 84


def test_the_plan_carries_the_prediction_with_an_empty_cache_and_the_cells_of_its_context():
    nodes = [planner.Node("desk", "127.0.0.1", (cpu("desk", 8192, 10.0),), coordinator=True)]
    big_kv = {**profile(), "head_count_kv": [8] * 4, "key_length": [128] * 4, "value_length": [128] * 4}
    plan = planner.plan(big_kv, nodes, planner.Settings(ctx=16384))
    assert plan["kv_cells"] == 16384
    kv = sum(p["kv_bytes"] for p in plan["placements"])
    saved = 1 / plan["predicted_tokens_per_s"] - 1 / plan["predicted_tokens_per_s_empty"]
    # The only difference is the KV cache read by every token, at the device's bandwidth.
    assert saved == pytest.approx(kv / 10e9, rel=1e-3) and kv > 0


PROC_BEFORE = """0.50 0.40 0.30 1/200 12345
cpu  1000 0 500 8000 100 0 0 0 0 0
cpu0 500 0 250 4000 50 0 0 0 0 0
cpu1 500 0 250 4000 50 0 0 0 0 0
intr 0
4242 (llama-server) S 1 4242 4242 0 -1 4194560 100 0 0 0 300 100 0 0 20 0 4 0 100 0 0
"""
# 1000 ticks later on 2 CPUs (500 each): the machine busy 900 ticks, llama-server 300 of them.
PROC_AFTER = """2.10 0.90 0.40 3/200 12399
cpu  1700 0 700 8100 100 0 0 0 0 0
cpu0 850 0 350 4050 50 0 0 0 0 0
cpu1 850 0 350 4050 50 0 0 0 0 0
intr 0
4242 (llama-server) R 1 4242 4242 0 -1 4194560 100 0 0 0 550 150 0 0 20 0 4 0 100 0 0
"""


def test_what_other_programs_used_while_llama_server_decoded_is_the_machines_time_less_its_own():
    before, after = parse_proc(PROC_BEFORE), parse_proc(PROC_AFTER)
    assert after == {"cpus": 2, "load1": 2.1, "total": 10600, "busy": 2400, "own": 700}
    use = cpu_use(before, after)
    assert use == {"cpus": 2, "others_cpus": 1.2, "own_cpus": 0.6, "load1": 2.1}


def test_no_reading_no_figure():
    assert cpu_use({}, parse_proc(PROC_AFTER)) is None
    assert cpu_use(parse_proc(PROC_AFTER), parse_proc(PROC_AFTER)) is None  # no time passed
    assert parse_proc("") == {"cpus": 0}


FIGURES = [{"node": "pc", "reason": "never calibrated: the plan used table figures for it"}]
LINKS = [{"node": "pc", "reason": "its link is slow"}]
BUSY = {"cpus": 2, "others_cpus": 1.2, "own_cpus": 0.6, "load1": 2.1}


def test_a_slow_measurement_on_a_busy_machine_names_the_load_first_not_only_a_calibration():
    causes = miss_causes({"error": -0.6, "cpu_use": BUSY}, coordinator="desk", figures=FIGURES, links=[])
    assert [(c["node"], c["kind"]) for c in causes] == [("desk", "load"), ("pc", "calibration")]
    assert causes[0]["reason"].startswith(
        "it was busy while it was measured: other programs used 1.2 of its 2"
    )
    assert "load average 2.1" in causes[0]["reason"]
    alone = miss_causes({"error": -0.6, "cpu_use": BUSY}, coordinator="desk", figures=[], links=[])
    assert [c["kind"] for c in alone] == ["load"]


def test_a_quiet_machine_or_a_faster_run_is_not_blamed_on_load():
    quiet = {**BUSY, "others_cpus": 0.1}
    assert miss_causes({"error": -0.6, "cpu_use": quiet}, coordinator="desk", figures=[], links=[]) == []
    faster = miss_causes({"error": 0.6, "cpu_use": BUSY}, coordinator="desk", figures=[], links=[])
    assert faster == []


def test_a_faster_run_priced_at_the_full_context_names_the_context():
    check = {"error": 1.8, "at_filled_context": False, "filled": 84, "kv_cells": 16384}
    [cause] = miss_causes(check, coordinator="desk", figures=[], links=[])
    assert (
        cause["kind"] == "context" and "full context (16384 tokens) and this run filled 84" in cause["reason"]
    )
    # Compared at the context it filled, the context is not a cause.
    assert miss_causes({**check, "at_filled_context": True}, coordinator="desk", figures=[], links=[]) == []


def test_the_figures_are_named_before_a_slow_link_and_nothing_within_the_limit():
    check = {"error": -0.4}
    assert [c["kind"] for c in miss_causes(check, coordinator="d", figures=FIGURES, links=LINKS)] == [
        "calibration"
    ]
    assert [c["kind"] for c in miss_causes(check, coordinator="d", figures=[], links=LINKS)] == ["link"]
    assert miss_causes({"error": -0.2, "cpu_use": BUSY}, coordinator="d", figures=FIGURES, links=LINKS) == []
    assert miss_causes({"error": None}, coordinator="d", figures=FIGURES, links=LINKS) == []


def test_a_busy_worker_is_named_beside_a_quiet_coordinator():
    quiet = {**BUSY, "others_cpus": 0.1}
    check = {"error": -0.6, "cpu_use": quiet, "workers_cpu_use": {"pc": BUSY, "laptop": quiet}}
    causes = miss_causes(check, coordinator="desk", figures=FIGURES, links=[])
    assert [(c["node"], c["kind"]) for c in causes] == [("pc", "load"), ("pc", "calibration")]
    assert (
        "other programs used 1.2 of its 2 CPUs, load average 2.1 beside its rpc-server" in causes[0]["reason"]
    )
    # A faster run is never blamed on a worker's load either.
    assert miss_causes({**check, "error": 0.6}, coordinator="desk", figures=[], links=[]) == []
