"""The planner's speed model with calibrated figures: measured beats the table, the coordinator's fixed cost
of a pass and each remote node's hop are counted, and the deployment page compares the prediction with what
was measured."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from deployments.models import Deployment
from modelfiles.models import ModelFile
from nodes.models import Device
from nodes.pool import planner_nodes, stale_calibration_warnings
from planning import planner
from tests.factories import DeviceFactory, NodeFactory

MIB = 2**20
MB = 1e6


def profile(blocks: int = 4, block_bytes: int = 50_000_000) -> dict:
    """A small llama-like profile: `blocks` equal blocks, a tiny output layer, no KV to speak of."""
    return {
        "name": "toy",
        "architecture": "llama",
        "block_count": blocks,
        "block_weight_bytes": [block_bytes] * blocks,
        "output_bytes": 1_000_000,
        "input_embedding_bytes": 1_000_000,
        "other_bytes": 0,
        "embedding_length": 256,
        "feed_forward_length": 512,
        "vocab_size": 300,
        "head_count_kv": [1] * blocks,
        "key_length": [8] * blocks,
        "value_length": [8] * blocks,
        "context_length": 2048,
        "weights_total_bytes": blocks * block_bytes + 2_000_000,
    }


def cpu(node: str, mib: int, gbs: float, **fields) -> planner.Device:
    return planner.Device(node, "CPU", "cpu", mib * MIB, mib * MIB, gbs, **fields)


def test_the_prediction_counts_the_pass_the_bytes_the_hop_and_the_round_trips():
    nodes = [
        planner.Node("desk", "127.0.0.1", (cpu("desk", 16, 10.0),), coordinator=True, pass_overhead_ms=2.0),
        planner.Node("pc", "10.0.0.2", (cpu("pc", 4096, 20.0),), rtt_ms=0.2, hop_ms=1.5),
    ]
    plan = planner.plan(profile(), nodes, planner.Settings(ctx=256))
    assert [p["node"] for p in plan["placements"] if p["layers"]] == ["pc"]
    read = 4 * 50_000_000 + 1_000_000
    kv = sum(p["kv_bytes"] for p in plan["placements"])
    seconds = 0.002 + (read + kv) / 20e9 + 0.0015 + 3 * 0.0002
    assert 1 / plan["predicted_tokens_per_s"] == pytest.approx(seconds, rel=1e-3)
    assert plan["speed_model"] == {
        "pass_overhead_ms": 2.0,
        "hop_ms": {"pc": 2.1},
        "pipeline_overhead_ms": 0.0,
        "quota_period_ms": {},
    }


def test_an_uncalibrated_cluster_pays_the_default_costs_and_the_plan_says_its_figures_are_guesses():
    nodes = [
        planner.Node("desk", "127.0.0.1", (cpu("desk", 16, 10.0),), coordinator=True),
        planner.Node("pc", "10.0.0.2", (cpu("pc", 4096, 20.0),), rtt_ms=0.0),
    ]
    plan = planner.plan(profile(), nodes, planner.Settings(ctx=256))
    assert plan["speed_model"] == {
        "pass_overhead_ms": planner.DEFAULT_PASS_OVERHEAD_MS,
        "hop_ms": {"pc": planner.DEFAULT_HOP_MS},
        "pipeline_overhead_ms": 0.0,
        "quota_period_ms": {},
    }
    assert any("desk/CPU, pc/CPU comes from a table" in w for w in plan["warnings"])
    assert any("desk is not calibrated" in w for w in plan["warnings"])


def test_a_split_across_servers_pays_the_coordinators_pipeline_cost_and_avoids_it_when_dear():
    def cluster(pipeline_ms: float) -> list[planner.Node]:
        # The coordinator holds no block; no worker holds the whole model: every block goes to the
        # workers, which is llama.cpp's pipeline parallelism, unless the coordinator's slow CPU takes some.
        return [
            planner.Node("desk", "127.0.0.1", (cpu("desk", 150, 1.0),), coordinator=True,
                         pass_overhead_ms=1.0, pipeline_overhead_ms=pipeline_ms),
            planner.Node("a", "10.0.0.2", (cpu("a", 200, 20.0),), rtt_ms=0.0, hop_ms=0.5),
            planner.Node("b", "10.0.0.3", (cpu("b", 200, 20.0),), rtt_ms=0.0, hop_ms=0.5),
        ]  # fmt: skip

    cheap = planner.plan(profile(), cluster(2.0), planner.Settings(ctx=256))
    assert cheap["pipeline_parallel"] and cheap["speed_model"]["pipeline_overhead_ms"] == 2.0
    seconds = (
        0.001 + 0.002 + 2 * 0.0005 + (4 * 50e6 + 1e6 + sum(p["kv_bytes"] for p in cheap["placements"])) / 20e9
    )
    assert 1 / cheap["predicted_tokens_per_s"] == pytest.approx(seconds, rel=1e-3)
    # 60 ms of pipeline cost: one block on the coordinator's slow CPU (50 ms) is cheaper.
    dear = planner.plan(profile(), cluster(60.0), planner.Settings(ctx=256))
    assert not dear["pipeline_parallel"] and dear["placements"][0]["layers"] == 1


def test_a_hop_that_costs_more_than_it_saves_keeps_the_model_on_the_coordinator():
    def cluster(hop_ms: float) -> list[planner.Node]:
        return [
            planner.Node("desk", "127.0.0.1", (cpu("desk", 4096, 10.0),), coordinator=True),
            planner.Node("pc", "10.0.0.2", (cpu("pc", 4096, 11.0),), rtt_ms=0.0, hop_ms=hop_ms),
        ]

    # 201 MB at 10 vs 11 GB/s: the worker saves 1.8 ms per token, so a 0.5 ms hop is worth it, 5 ms is not.
    cheap = planner.plan(profile(), cluster(0.5), planner.Settings(ctx=256))
    dear = planner.plan(profile(), cluster(5.0), planner.Settings(ctx=256))
    assert any(p["node"] == "pc" and p["layers"] for p in cheap["placements"])
    assert not any(p["node"] == "pc" and p["layers"] for p in dear["placements"])


def test_blocks_on_the_coordinators_cpu_run_at_its_speed_inside_llama_server():
    alone = [
        planner.Node(
            "desk",
            "127.0.0.1",
            (cpu("desk", 4096, 20.0, bandwidth_source="measured", local_bandwidth_gbs=2.0),),
            coordinator=True,
            pass_overhead_ms=1.0,
        )
    ]
    plan = planner.plan(profile(), alone, planner.Settings(ctx=256))
    [placement] = plan["placements"]
    assert placement["bandwidth_gbs"] == 2.0 and placement["bandwidth_source"] == "measured"
    assert 1 / plan["predicted_tokens_per_s"] == pytest.approx(0.001 + 202e6 / 2e9, rel=0.01)


@pytest.mark.django_db
def test_the_planner_takes_the_override_then_the_measurement_then_the_table():
    desk = NodeFactory(name="desk", may_coordinate=True, facts={"cpu_cores": 4})
    device = DeviceFactory(node=desk, bandwidth_gbs=120.0, total_bytes=8 * 2**30, free_bytes=8 * 2**30)

    def planned() -> planner.Device:
        return planner_nodes([], desk)[0].devices[0]

    assert (planned().bandwidth_gbs, planned().bandwidth_source) == (120.0, "table")
    device.record_measurement(bandwidth_gbs=9.0, overhead_ms=1.0, local_bandwidth_gbs=3.0)
    desk.calibrated_at, desk.pass_overhead_ms, desk.rpc_hop_ms, desk.link_rtt_ms = (
        timezone.now(),
        1.5,
        0.4,
        0.1,
    )
    desk.save()
    node = planner_nodes([], desk)[0]
    assert (node.devices[0].bandwidth_gbs, node.devices[0].bandwidth_source) == (9.0, "measured")
    assert node.devices[0].local_bandwidth_gbs == 3.0
    assert (node.pass_overhead_ms, node.hop_ms, node.rtt_ms) == (1.5, 0.4, 0.1)
    Device.objects.filter(pk=device.pk).update(bandwidth_override_gbs=50.0)
    node = planner_nodes([], desk)[0]
    assert (node.devices[0].bandwidth_gbs, node.devices[0].local_bandwidth_gbs) == (50.0, None)
    # Other hardware since: neither the device's figure nor the node's costs are used any more.
    Device.objects.filter(pk=device.pk).update(bandwidth_override_gbs=None, description="another CPU")
    node = planner_nodes([], desk)[0]
    assert node.devices[0].bandwidth_gbs == 120.0 and node.pass_overhead_ms is None and node.hop_ms is None


@pytest.mark.django_db
def test_an_old_calibration_is_used_with_a_warning(settings):
    settings.RAMDECK_CALIBRATION_MAX_AGE_DAYS = 30
    desk = NodeFactory(name="desk")
    device = DeviceFactory(node=desk, bandwidth_gbs=120.0)
    device.record_measurement(bandwidth_gbs=9.0, overhead_ms=1.0)
    Device.objects.filter(pk=device.pk).update(measured_at=timezone.now() - timedelta(days=40))
    assert planner_nodes([], desk)[0].devices[0].bandwidth_gbs == 9.0
    [warning] = stale_calibration_warnings([desk])
    assert "desk/CPU is older than 30 days" in warning


def _deployment(measured: float | None, predicted: float = 100.0, **node_fields) -> Deployment:
    desk = NodeFactory(name="desk", may_coordinate=True, **node_fields)
    pc = NodeFactory(name="pc")
    for node in (desk, pc):
        DeviceFactory(node=node, bandwidth_gbs=40.0).record_measurement(bandwidth_gbs=8.0, overhead_ms=1.0)
    model = ModelFile.objects.create(name="m", node=desk, path="/m.gguf", profile={})
    plan = {
        "predicted_tokens_per_s": predicted,
        "placements": [
            {"node": "desk", "device": "CPU", "layers": 1, "output_layer": False, "ms_per_token": 1.0},
            {"node": "pc", "device": "CPU", "layers": 7, "output_layer": True, "ms_per_token": 8.0},
        ],
    }
    return Deployment.objects.create(
        name="chat",
        model_file=model,
        coordinator=desk,
        plan=plan,
        measured_decode_tps=measured,
        predicted_decode_tps=predicted if measured else None,
    )


@pytest.mark.django_db
def test_the_deployment_page_shows_the_error_and_which_node_to_calibrate_again(operator_client, viewer_user):
    deployment = _deployment(measured=46.0, calibrated_at=timezone.now())
    NodeFactory._meta.model.objects.filter(name="pc").update(calibrated_at=timezone.now())
    assert deployment.speed_error == pytest.approx(-0.54)
    # Everything measured: the node the prediction leaned on most is the one to check.
    assert deployment.recalibration_advice() == ["pc"]
    viewer = Client()
    viewer.force_login(viewer_user)
    for url in (deployment.get_absolute_url(), f"/deployments/{deployment.pk}/run/"):
        page = operator_client.get(url).content.decode()
        assert "Measured 46.0 tok/s against 100.0 predicted" in page
        # A visible (red) badge, not grey text, with the likely reason and the way to re-calibrate.
        assert '<span class="badge bad" id="speed-flag">Prediction missed by -54%</span>' in page
        assert "slower than the planner expected, by more than 25%" in page
        assert "<strong>pc</strong>: its figures are fresh, but the prediction leans on them most" in page
        link = 'href="/nodes/pc/#hardware" class="recalibrate" data-action="calibration:node"'
        assert f"{link}>Re-calibrate pc</a>" in page
        # A viewer reads the reason, and is not sent to a calibration it may not start.
        page = viewer.get(url).content.decode()
        assert "<strong>pc</strong>: its figures are fresh" in page and "Re-calibrate" not in page


@pytest.mark.django_db
def test_uncalibrated_nodes_are_named_first_and_a_close_prediction_asks_for_nothing(viewer_client):
    deployment = _deployment(measured=46.0)
    assert deployment.recalibration_advice() == ["desk", "pc"]  # neither node was ever calibrated
    Deployment.objects.filter(pk=deployment.pk).update(measured_decode_tps=90.0)
    deployment.refresh_from_db()
    assert deployment.speed_error == pytest.approx(-0.1) and deployment.recalibration_advice() == []
    page = viewer_client.get(deployment.get_absolute_url()).content.decode()
    assert '<span class="badge ok" id="speed-flag">Prediction held (-10%)</span>' in page
    assert "(within 25%)" in page and "Re-calibrate" not in page and "badge bad" not in page


@pytest.mark.django_db
def test_a_missed_prediction_names_why_never_calibrated_stale_or_a_slow_link(settings):
    settings.RAMDECK_CALIBRATION_MAX_AGE_DAYS = 30
    deployment = _deployment(measured=46.0)
    reasons = {row["node"]: row["reason"] for row in deployment.speed_miss_reasons()}
    assert reasons == {
        "desk": "never calibrated: the plan used table figures for it",
        "pc": "never calibrated: the plan used table figures for it",
    }
    now = timezone.now()
    Node = NodeFactory._meta.model
    Node.objects.update(calibrated_at=now)
    Device.objects.filter(node__name="pc").update(measured_at=now - timedelta(days=40))
    [row] = deployment.speed_miss_reasons()
    assert row == {
        "node": "pc",
        "kind": "calibration",
        "reason": "its calibration is stale (older than 30 days)",
    }
    # Fresh figures everywhere, but the worker's round trip is far slower now than when it was calibrated.
    Device.objects.update(measured_at=now)
    Node.objects.filter(name="pc").update(link_rtt_ms=0.4, rtt_ms=6.0)
    [row] = deployment.speed_miss_reasons()
    assert row["node"] == "pc" and row["reason"].startswith("its link is slow: a round trip takes 6.0 ms now")
    assert row["kind"] == "link"
    assert deployment.recalibration_advice() == ["pc"]
    # A prediction that was too pessimistic is a miss too: flagged the same way.
    Deployment.objects.filter(pk=deployment.pk).update(measured_decode_tps=140.0)
    deployment.refresh_from_db()
    assert deployment.speed_is_off and deployment.speed_error == pytest.approx(0.4)


def test_a_cluster_file_carries_calibrated_costs_and_bad_ones_are_named():
    data = {
        "nodes": [
            {
                "name": "desk",
                "coordinator": True,
                "pass_overhead_ms": 1.2,
                "devices": [{"name": "CPU", "total_mib": 64, "bandwidth_gbs": 9, "local_bandwidth_gbs": 2.5}],
            },
            {"name": "pc", "hop_ms": 0.7, "rtt_ms": 0.2, "devices": [{"name": "CPU", "total_mib": 64}]},
        ]
    }
    desk, pc = planner.cluster_from_dict(data)
    assert (desk.pass_overhead_ms, desk.devices[0].local_bandwidth_gbs) == (1.2, 2.5)
    assert (pc.hop_ms, pc.pass_overhead_ms) == (0.7, None)
    data["nodes"][1].update(cpu_quota_cores=0.25, cpu_quota_period_ms=100)
    assert planner.cluster_from_dict(data)[1].cpu_quota_cores == 0.25
    data["nodes"][1]["cpu_quota_cores"] = 0
    with pytest.raises(planner.ClusterError, match="Node 'pc': cpu_quota_cores must be a number of cores"):
        planner.cluster_from_dict(data)
    data["nodes"][1].update(cpu_quota_cores=0.25, cpu_quota_period_ms=float("inf"))
    with pytest.raises(planner.ClusterError, match="cpu_quota_period_ms must be a number of milliseconds"):
        planner.cluster_from_dict(data)
    data["nodes"][1]["cpu_quota_period_ms"] = 100
    data["nodes"][1]["hop_ms"] = "slow"
    with pytest.raises(planner.ClusterError, match="Node 'pc': hop_ms must be a number of milliseconds"):
        planner.cluster_from_dict(data)


def test_the_default_split_follows_what_llama_cpp_reports_not_the_container_limit():
    # Both rpc-servers report the machine's 16 GiB; one node's cgroup leaves it 600 MiB. llama.cpp splits by
    # what it is told (half each), so that is the baseline the plan is compared with.
    ram = 16 * 1024 * MIB
    nodes = [
        planner.Node("desk", "127.0.0.1", (cpu("desk", 16, 1.0),), coordinator=True),
        planner.Node("a", "10.0.0.2", (cpu("a", 600, 20.0, reported_free_bytes=ram),), rtt_ms=0.0),
        planner.Node("b", "10.0.0.3", (cpu("b", 8192, 2.0, reported_free_bytes=ram),), rtt_ms=0.0),
    ]
    plan = planner.plan(profile(), nodes, planner.Settings(ctx=256))
    layers = {p["node"]: p["layers"] for p in plan["baseline"]["placements"]}
    assert layers == {"desk": 0, "a": 3, "b": 1}  # 5 slots (4 blocks + output) split half and half


@pytest.mark.django_db
def test_the_context_shown_is_llama_cpps_with_the_requested_one_beside_it_when_they_differ(viewer_client):
    deployment = _deployment(measured=None)
    Deployment.objects.filter(pk=deployment.pk).update(plan_settings={"ctx": 8192}, state="running")
    deployment.refresh_from_db()
    page = viewer_client.get(deployment.get_absolute_url()).content.decode()
    assert '<span id="context-used">8192 <span class="muted">(asked for;' in page  # not read yet
    capped = {
        "n_ctx": 8192,
        "n_ctx_train": 4096,
        "n_slots": 1,
        "per_slot": 4096,
        "total": 4096,
        "capped": True,
    }
    deployment.record(ctx_used=4096, verification={"context": capped})
    assert deployment.ctx_differs
    assert deployment.ctx_note() == "llama.cpp capped each slot at the model's trained context (4,096)"
    for url in (deployment.get_absolute_url(), f"/deployments/{deployment.pk}/run/"):
        page = viewer_client.get(url).content.decode()
        assert (
            '<span id="context-used">4096 <span class="badge warn" id="context-requested">requested 8192'
            in page
        )
    # Rounded up to a multiple of 256, not capped: said so.
    Deployment.objects.filter(pk=deployment.pk).update(plan_settings={"ctx": 1000})
    deployment.refresh_from_db()
    rounded = {
        "n_ctx": 1024,
        "n_ctx_train": 4096,
        "n_slots": 1,
        "per_slot": 1024,
        "total": 1024,
        "capped": False,
    }
    deployment.record(ctx_used=1024, verification={"context": rounded})
    assert deployment.ctx_note().startswith("llama.cpp rounds the context to a multiple of 256")
    # The same as asked: nothing beside it.
    Deployment.objects.filter(pk=deployment.pk).update(plan_settings={"ctx": 1024})
    deployment.refresh_from_db()
    assert not deployment.ctx_differs and deployment.ctx_note() == ""
    assert 'id="context-requested"' not in viewer_client.get(deployment.get_absolute_url()).content.decode()


def test_a_worker_under_a_cpu_quota_starts_its_part_of_a_token_with_a_period_to_spend():
    """A quota is granted per period: a worker that waited for the others' part of the token starts with
    quota to spend at full speed and ends about a period sooner than its steady (calibrated) pace; never
    sooner than the same work at full speed."""
    desk = planner.Node(
        "desk", "127.0.0.1", (cpu("desk", 16, 10.0),), coordinator=True,
        pass_overhead_ms=1.0, pipeline_overhead_ms=0.0,
    )  # fmt: skip
    fast = planner.Node("fast", "10.0.0.2", (cpu("fast", 120, 20.0),), rtt_ms=0.0, hop_ms=1.0)
    quota = {"cpu_quota_cores": 0.1, "cpu_quota_period_ms": 10.0}
    slow = planner.Node(
        "slow", "10.0.0.3", (cpu("slow", 4096, 2.0, bandwidth_source="measured"),), rtt_ms=0.0, hop_ms=4.0,
        **quota,
    )  # fmt: skip
    problem = planner.build_problem(profile(), [desk, fast, slow], planner.Settings(ctx=256))
    fast_slot, slow_slot = problem.slots
    assert (slow_slot.burst_s, slow_slot.quota_cores) == (0.010, 0.1) and fast_slot.burst_s == 0.0
    # Two blocks on the slow worker: 100 MB at 2 GB/s and its 4 ms hop is 54 ms at the steady pace.
    split = planner.Split(0, [1, 0], [2, 2])
    kv = [sum(problem.kv[0:2]), sum(problem.kv[2:4])]
    slow_s = (100_000_000 + kv[0]) / 2e9 + 0.004
    fast_s = (100_000_000 + kv[1] + 1_000_000) / 20e9 + 0.001
    expected = 0.001 + (slow_s - 0.010) + fast_s
    assert planner.evaluate(problem, split).seconds_per_token == pytest.approx(expected, rel=1e-9)
    # Little work: never faster than that work at full speed (its steady time times the quota).
    assert slow_slot.quota_time(0.005) == pytest.approx(0.0005)
    assert slow_slot.quota_time(0.054) == pytest.approx(0.044)
    # The network's round trips are waiting on the wire: no quota speeds them up.
    far = replace(slow, rtt_ms=5.0)
    far_slot = planner.build_problem(profile(), [desk, fast, far], planner.Settings(ctx=256)).slots[1]
    assert far_slot.time_with_overhead(0.050) == pytest.approx(0.050 + 0.004 - 0.010 + 0.015)
    # A table's figure knows nothing of the quota: no gain is taken from it.
    guessed = replace(slow, devices=(cpu("slow", 4096, 2.0),))
    assert planner.build_problem(profile(), [desk, fast, guessed], planner.Settings()).slots[1].burst_s == 0.0
    plan = planner.plan(profile(), [desk, fast, slow], planner.Settings(ctx=256))
    used = plan["speed_model"]["hop_ms"]
    assert plan["speed_model"]["quota_period_ms"] == ({"slow": 10.0} if "slow" in used else {})


def test_a_cpu_quota_counts_only_where_it_binds_and_only_for_a_cpu_alone_on_its_node():
    from nodes.pool import binding_cpu_quota

    assert binding_cpu_quota({"cpu_quota_cores": 0.5, "cpu_quota_period_ms": 100.0, "cpu_cores": 4}) == {
        "cpu_quota_cores": 0.5,
        "cpu_quota_period_ms": 100.0,
    }
    assert binding_cpu_quota({"cpu_quota_cores": 4.0, "cpu_quota_period_ms": 100.0, "cpu_cores": 4}) == {}
    assert binding_cpu_quota({"cpu_quota_cores": 0.5, "cpu_cores": 4}) == {}  # probed before the period
    assert binding_cpu_quota({}) == {}
    gpu = planner.Device("box", "CUDA0", "cuda", 8192 * MIB, 8192 * MIB, 300.0)
    quota = {"cpu_quota_cores": 0.5, "cpu_quota_period_ms": 100.0}
    desk = planner.Node("desk", "127.0.0.1", (cpu("desk", 16, 10.0),), coordinator=True)
    box = planner.Node("box", "10.0.0.2", (cpu("box", 4096, 20.0, bandwidth_source="measured"), gpu), **quota)
    problem = planner.build_problem(profile(), [desk, box], planner.Settings(ctx=256))
    assert all(slot.burst_s == 0.0 for slot in problem.slots)  # the quota is the CPU's, not the GPU's


@pytest.mark.django_db
def test_the_planner_takes_the_quota_the_probe_found_on_the_node():
    node = NodeFactory(
        name="slow", facts={"cpu_quota_cores": 0.1, "cpu_quota_period_ms": 10.0, "cpu_cores": 2}
    )
    coordinator = NodeFactory(name="desk", may_coordinate=True)
    for row in (node, coordinator):
        DeviceFactory(node=row, name="CPU", kind="cpu")
    planned = {n.name: n for n in planner_nodes([node, coordinator], coordinator)}
    assert (planned["slow"].cpu_quota_cores, planned["slow"].cpu_quota_period_ms) == (0.1, 10.0)
    assert planned["desk"].cpu_quota_cores is None


@pytest.mark.django_db
def test_the_deployment_page_sets_first_token_and_load_beside_their_predictions(viewer_client):
    deployment = _deployment(measured=90.0)
    first = {"prompt_tokens": 2000, "ttft_s": 6.0, "ttft_samples": [6.0, 6.1], "ttft_predicted_s": 4.0,
             "ttft_error": 0.5, "load_s": 11.0, "load_kind": "cold", "load_predicted_s": 10.0,
             "load_error": 0.1}  # fmt: skip
    Deployment.objects.filter(pk=deployment.pk).update(verification={"first_word": first})
    page = viewer_client.get(deployment.get_absolute_url()).content.decode()
    # The first token missed by half again: a red badge; the load within 25%: held.
    assert '<span class="badge bad" id="ttft-flag">First token missed by +50%</span>' in page
    assert "First token after a 2000-token prompt: 6.00 s measured against 4.00 s predicted" in page
    assert '<span class="badge ok" id="load-flag">Load held (+10%)</span>' in page
    assert "Load (cold): 11.0 s from llama-server's start to its health answer against 10.0 s" in page


@pytest.mark.django_db
def test_a_load_is_warm_once_its_workers_received_the_model_through_a_deployment():
    deployment = _deployment(measured=None)
    plan = {**deployment.plan, "placements": [{**p, "endpoint": "10.0.0.2:50052"} if p["node"] == "pc" else p
                                              for p in deployment.plan["placements"]]}  # fmt: skip
    Deployment.objects.filter(pk=deployment.pk).update(plan=plan)
    deployment.refresh_from_db()
    deployment.count_load()
    assert deployment.loads == 1 and deployment.load_kind() == "cold"
    deployment.count_load()  # a restart: the worker's RPC cache holds the large tensors now
    assert deployment.load_kind() == "warm"
    # Another deployment of the same model on the same worker starts warm; on no worker it has no cache.
    other = Deployment.objects.create(name="again", model_file=deployment.model_file,
                                      coordinator=deployment.coordinator, plan=plan)  # fmt: skip
    assert other.load_kind() == "warm"
    alone = Deployment.objects.create(
        name="alone", model_file=deployment.model_file, coordinator=deployment.coordinator, plan={}
    )
    assert alone.load_kind() == "cold"


@pytest.mark.django_db
def test_a_first_load_is_warm_when_each_worker_holds_a_registered_copy_of_the_model():
    from modelfiles.models import ModelCopy

    deployment = _deployment(measured=None)
    plan = {**deployment.plan, "placements": [{**p, "endpoint": "10.0.0.2:50052"} if p["node"] == "pc" else p
                                              for p in deployment.plan["placements"]]}  # fmt: skip
    Deployment.objects.filter(pk=deployment.pk).update(plan=plan)
    deployment.refresh_from_db()
    assert deployment.load_kind() == "cold"
    pc = deployment.model_file.node.__class__.objects.get(name="pc")
    ModelCopy.objects.create(
        model=deployment.model_file, node=pc, path="/m/copy.gguf", size_bytes=1, sha256="0" * 64
    )
    # Its cache was filled from the copy (by the copy job, or before its rpc-server starts): priced warm.
    assert deployment.load_kind() == "warm"
