"""The clamped waterfill planner: properties (hypothesis), optimality against exhaustive search, scenarios."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamacpp.args import layer_assignment
from planning import planner
from planning.planner import GIB, MIB, Device, Node, Settings
from tests.planning.profiles import make_profile

pytestmark = pytest.mark.filterwarnings("ignore")


def dev(
    node: str, name: str, gib: float, bw: float, kind: str = "cpu", free: float | None = None, unified=False
):
    total = int(gib * GIB)
    return Device(node, name, kind, total, int((free if free is not None else gib) * GIB), bw, unified)


def cluster(coordinator_devices, *remotes) -> list[Node]:
    """Remotes are (name, devices, rtt) or (name, devices, rtt, {more Node fields})."""
    nodes = [Node("desk", "10.0.0.1", tuple(coordinator_devices), coordinator=True)]
    for i, (name, devices, rtt, *more) in enumerate(remotes):
        fields = more[0] if more else {}
        nodes.append(Node(name, f"10.0.0.{i + 2}", tuple(devices), rpc_port=50052, rtt_ms=rtt, **fields))
    return nodes


# ---------------------------------------------------------------------------------------------------------
# Exhaustive search over every split llama.cpp can express (device subsets, orders, whole-block counts)


def exhaustive(problem: planner.Problem) -> float:
    n = len(problem.block_bytes)
    best = math.inf
    slots = range(len(problem.slots))
    for size in range(len(problem.slots) + 1):
        for order in itertools.permutations(slots, size):
            for cpu_blocks in range(n + 1):
                rest = n - cpu_blocks
                if not order:
                    if rest:
                        continue
                    candidates = [[]]
                else:
                    # Listed devices hold a block or more, except the last, which may hold only the output.
                    candidates = [
                        [*c, rest - sum(c)]
                        for c in itertools.product(range(1, rest + 1), repeat=size - 1)
                        if sum(c) <= rest
                    ]
                for counts in candidates:
                    ev = planner.evaluate(problem, planner.Split(cpu_blocks, list(order), list(counts)))
                    if ev.fits:
                        best = min(best, ev.seconds_per_token)
    return best


@st.composite
def instances(draw):
    n_layer = draw(st.integers(1, 5))
    block_mib = draw(st.sampled_from([100.0, 400.0, 1000.0]))
    profile = make_profile(
        n_layer=n_layer, block_mib=block_mib, output_mib=draw(st.sampled_from([50.0, 500.0]))
    )
    unit = block_mib / 1024  # GiB per block
    bandwidths = st.sampled_from([10.0, 40.0, 100.0, 400.0, 900.0])

    def capacity() -> float:
        return unit * draw(st.floats(0.0, n_layer + 2.5)) + 0.3

    coord = [dev("desk", "CPU", capacity() + unit * 0.5, draw(bandwidths))]
    if draw(st.booleans()):
        coord.append(dev("desk", "CUDA0", capacity(), draw(bandwidths), kind="cuda"))
    remotes = []
    count = len(coord)
    for r in range(draw(st.integers(0, 5 - len(coord)))):
        if count >= 5:
            break
        name = f"r{r}"
        devices = [dev(name, "CPU", capacity(), draw(bandwidths))]
        count += 1
        if count < 5 and draw(st.booleans()):
            count += 1
            devices.append(dev(name, "Vulkan0", capacity(), draw(bandwidths), kind="vulkan"))
        # Some CPU workers are held to a CPU quota (a container, a throttled machine), granted per period.
        quota = draw(st.sampled_from([None, None, (0.1, 10.0), (0.5, 100.0)]))
        fields = {"cpu_quota_cores": quota[0], "cpu_quota_period_ms": quota[1]} if quota else {}
        if quota:  # the planner counts a quota's gain only against a measured figure
            devices[0] = replace(devices[0], bandwidth_source="measured")
        remotes.append((name, devices, draw(st.sampled_from([0.1, 1.0, 10.0, 60.0])), fields))
    nodes = cluster(coord, *remotes)
    cfg = Settings(ctx=draw(st.sampled_from([512, 2048])), margin_fraction=0.0)
    return profile, nodes, cfg


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_planner_is_optimal_against_exhaustive_search(instance):
    profile, nodes, cfg = instance
    problem = planner.build_problem(profile, nodes, cfg)
    assert len(problem.slots) + 1 <= 5  # up to five devices, the coordinator's CPU included
    split, seconds = planner.search(problem)
    brute = exhaustive(problem)
    if brute == math.inf:
        assert split is None
    else:
        assert split is not None
        assert seconds == pytest.approx(brute, rel=1e-9)
        assert planner.evaluate(problem, split).seconds_per_token == pytest.approx(seconds, rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(instances())
def test_no_plan_exceeds_usable_memory_and_every_block_is_placed_once(instance):
    profile, nodes, cfg = instance
    result = planner.plan(profile, nodes, cfg)
    json.dumps(result)  # JSON-able
    if not result["fits"]:
        assert result["placements"] == []
        return
    placements = result["placements"]
    for p in placements:
        assert p["weights_bytes"] + p["kv_bytes"] + p["compute_bytes"] <= p["capacity_bytes"]
        assert p["capacity_bytes"] <= p["free_bytes"]
    # Contiguous slices, each block exactly once, output layer exactly once and on the last device.
    covered = []
    for p in placements:
        covered += range(p["first_layer"], p["first_layer"] + p["layers"])
    assert covered == list(range(profile["block_count"]))
    assert sum(p["output_layer"] for p in placements) == 1
    assert placements[-1]["output_layer"]
    assert_args_reproduce_placements(result)


def assert_args_reproduce_placements(result: dict) -> None:
    """llama.cpp's own assignment rule applied to the planned -ngl/-ts gives exactly the planned blocks."""
    args = result["llama_server_args"]
    n = result["n_layer"]
    ngl = int(args[args.index("-ngl") + 1])
    devices = [p for p in result["placements"] if p["llama_device"] != "CPU"]
    assert args[args.index("--device") + 1] == (",".join(p["llama_device"] for p in devices) or "none")
    shares = [float(x) for x in args[args.index("-ts") + 1].split(",")] if "-ts" in args else []
    slots = layer_assignment(shares, n, ngl)
    cpu = next(p for p in result["placements"] if p["llama_device"] == "CPU")
    assert slots[: cpu["layers"]] == [-1] * cpu["layers"]
    for k, p in enumerate(devices):
        assert slots[p["first_layer"] : p["first_layer"] + p["layers"]] == [k] * p["layers"]
    assert slots[n] == (len(devices) - 1 if devices else -1)
    assert "--fit" in args and args[args.index("--fit") + 1] == "off"
    assert args[args.index("-c") + 1] == str(result["settings"]["ctx"])


@settings(max_examples=40, deadline=None)
@given(instances())
def test_plans_are_deterministic(instance):
    profile, nodes, cfg = instance
    assert planner.plan(profile, nodes, cfg) == planner.plan(profile, nodes, cfg)


# ---------------------------------------------------------------------------------------------------------
# A Mac coordinator: its CPU and its MTL0 draw on one unified pool


@st.composite
def mac_instances(draw):
    """A Mac coordinator described by its MTL0 alone (or with its CPU listed too), perhaps with a wired limit,
    and perhaps workers; up to five devices with the coordinator's CPU, as in `instances`."""
    n_layer = draw(st.integers(1, 5))
    block_mib = draw(st.sampled_from([100.0, 400.0, 1000.0]))
    profile = make_profile(
        n_layer=n_layer, block_mib=block_mib, output_mib=draw(st.sampled_from([50.0, 500.0]))
    )
    unit = block_mib / 1024  # GiB per block
    bandwidths = st.sampled_from([10.0, 40.0, 100.0, 400.0, 900.0])
    clamp = draw(st.sampled_from([0.5, 0.7, 0.9, 1.0]))
    ram = (unit * draw(st.floats(0.0, n_layer + 3.5)) + 0.6) / clamp
    wired = draw(st.sampled_from([0.0, 0.3, 0.6, 0.8, 0.95])) * ram
    mtl0 = Device(
        "mac", "MTL0", "metal", int(ram * GIB), int(ram * GIB), draw(bandwidths), True, int(wired * GIB)
    )
    devices = [mtl0]
    if draw(st.booleans()):
        devices.append(dev("mac", "CPU", ram, draw(bandwidths), free=ram * draw(st.floats(0.3, 1.0))))
    nodes = [Node("mac", "10.0.0.1", tuple(devices), coordinator=True)]
    slots = 1
    for r in range(draw(st.integers(0, 3))):
        name = f"r{r}"
        workers = [dev(name, "CPU", unit * draw(st.floats(0.0, n_layer + 2.5)) + 0.3, draw(bandwidths))]
        if slots + 2 <= 4 and draw(st.booleans()):
            workers.append(dev(name, "CUDA0", unit * draw(st.floats(0.0, n_layer + 2.5)) + 0.3,
                               draw(bandwidths), kind="cuda"))  # fmt: skip
        if slots + len(workers) > 4:
            break
        slots += len(workers)
        nodes.append(
            Node(name, f"10.0.0.{r + 2}", tuple(workers), rtt_ms=draw(st.sampled_from([0.1, 1.0, 10.0])))
        )
    cfg = Settings(
        ctx=draw(st.sampled_from([512, 2048])),
        clamp=clamp,
        margin_fraction=draw(st.sampled_from([0.0, 0.03])),
    )
    return profile, nodes, cfg


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mac_instances())
def test_planner_is_optimal_with_a_mac_coordinator(instance):
    profile, nodes, cfg = instance
    problem = planner.build_problem(profile, nodes, cfg)
    assert problem.pool_slot is not None and len(problem.slots) + 1 <= 5
    split, seconds = planner.search(problem)
    brute = exhaustive(problem)
    if brute == math.inf:
        assert split is None
    else:
        assert split is not None
        assert seconds == pytest.approx(brute, rel=1e-9)
        ev = planner.evaluate(problem, split)
        assert ev.fits and ev.seconds_per_token == pytest.approx(seconds, rel=1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mac_instances())
def test_a_mac_coordinator_never_overcommits_its_one_pool(instance):
    profile, nodes, cfg = instance
    result = planner.plan(profile, nodes, cfg)
    mtl0 = nodes[0].devices[0]
    ram = mtl0.total_bytes
    pool_limit = int(cfg.clamp * ram)
    gpu_limit = min(pool_limit, mtl0.wired_limit_bytes or pool_limit)
    for plan_or_baseline in (result, result["baseline"]):
        on_mac = [p for p in plan_or_baseline["placements"] if p["node"] == "mac"]
        if plan_or_baseline["fits"]:
            # All llama.cpp takes on the Mac, its CPU's share included: within clamp x RAM less the margin.
            assert sum(p["used_bytes"] for p in on_mac) <= pool_limit * (1 - cfg.margin_fraction)
            for p in on_mac:
                assert p["used_bytes"] <= p["capacity_bytes"]
                if p["device"] == "MTL0":
                    assert p["limit_bytes"] <= gpu_limit
    if result["fits"]:
        assert result["placements"][0]["device"] == "CPU" and result["placements"][0]["node"] == "mac"
        assert result["unified_pool"]["used_bytes"] <= result["unified_pool"]["capacity_bytes"]
        assert_args_reproduce_placements(result)


def test_a_mac_coordinator_alone_needs_no_cpu_device_but_a_worker_may_not_list_both():
    mac = Node(
        "mac", "10.0.0.1", (dev("mac", "MTL0", 32, 400, kind="metal", unified=True),), coordinator=True
    )
    problem = planner.build_problem(make_profile(), [mac], Settings())
    assert problem.cpu.device.name == "CPU" and problem.cpu.limit == problem.pool_limit == int(0.7 * 32 * GIB)
    pc = Node("pc", "10.0.0.1", (dev("pc", "CPU", 32, 40),), coordinator=True)
    both = Node(
        "mac", "10.0.0.2", (dev("mac", "MTL0", 32, 400, "metal", unified=True), dev("mac", "CPU", 32, 100))
    )
    with pytest.raises(planner.ClusterError, match="same memory"):
        planner.build_problem(make_profile(), [pc, both], Settings())
    twice = Node("mac", "10.0.0.2", (dev("mac", "MTL0", 32, 400, "metal", unified=True),
                                      dev("mac", "MTL1", 32, 400, "metal", unified=True)))  # fmt: skip
    with pytest.raises(planner.ClusterError, match="several unified-memory devices"):
        planner.build_problem(make_profile(), [pc, twice], Settings())
    gpu_only = Node("box", "10.0.0.1", (dev("box", "CUDA0", 24, 900, "cuda"),), coordinator=True)
    with pytest.raises(planner.ClusterError, match="needs a CPU device"):
        planner.build_problem(make_profile(), [gpu_only], Settings())


# ---------------------------------------------------------------------------------------------------------
# Scenarios


def test_fast_gpu_filled_before_slow_cpu():
    profile = make_profile(n_layer=32, block_mib=400)
    nodes = cluster([dev("desk", "CPU", 64, 50), dev("desk", "CUDA0", 8, 900, kind="cuda")])
    result = planner.plan(profile, nodes, Settings(ctx=4096))
    gpu = next(p for p in result["placements"] if p["device"] == "CUDA0")
    cpu = result["placements"][0]
    assert gpu["layers"] > 0 and cpu["layers"] > 0
    # The GPU is filled: one more block would not fit.
    assert gpu["used_bytes"] + 400 * MIB + profile_block_kv(profile) > gpu["capacity_bytes"]
    assert cpu["layers"] + gpu["layers"] == 32
    assert (
        result["predicted_tokens_per_s"] > result["baseline"]["predicted_tokens_per_s"]
        or not result["baseline"]["fits"]
    )


def profile_block_kv(profile: dict) -> int:
    return planner.kv_bytes_per_block(profile, Settings(ctx=4096))[0]


def test_unified_memory_clamped_to_70_percent():
    mac = dev("mac", "MTL0", 32, 400, kind="metal", unified=True)
    nodes = cluster([dev("desk", "CPU", 128, 30)], ("mac", [mac], 0.5))
    profile = make_profile(n_layer=64, block_mib=500)
    result = planner.plan(profile, nodes, Settings(ctx=4096))
    metal = next(p for p in result["placements"] if p["device"] == "MTL0")
    assert metal["limit_bytes"] == int(0.7 * 32 * GIB)
    assert metal["used_bytes"] <= 0.7 * 32 * GIB
    assert metal["layers"] > 0
    more = planner.plan(profile, nodes, Settings(ctx=4096, clamp=0.9))
    assert next(p for p in more["placements"] if p["device"] == "MTL0")["layers"] > metal["layers"]
    assert "-d" in more["rpc_servers"][0]["args"] and "MTL0" in more["rpc_servers"][0]["args"]


def test_remote_node_left_out_when_it_only_adds_overhead():
    profile = make_profile(n_layer=8, block_mib=100)
    slow_far = dev("far", "CPU", 64, 10)
    nodes = cluster(
        [dev("desk", "CPU", 8, 20), dev("desk", "CUDA0", 24, 900, kind="cuda")], ("far", [slow_far], 5)
    )
    result = planner.plan(profile, nodes, Settings(ctx=2048))
    assert [p["device"] for p in result["placements"]] == ["CPU", "CUDA0"]
    assert "far/CPU" in result["unused_devices"]
    assert "--rpc" not in result["llama_server_args"]
    assert result["rpc_servers"] == []


def test_rpc_devices_come_first_with_endpoints_and_output_on_the_last_device():
    profile = make_profile(n_layer=40, block_mib=400)
    nodes = cluster(
        [dev("desk", "CPU", 16, 40), dev("desk", "CUDA0", 12, 900, kind="cuda")],
        ("mac", [dev("mac", "MTL0", 32, 400, kind="metal", unified=True)], 0.5),
        ("pc", [dev("pc", "CPU", 32, 50)], 0.5),
    )
    result = planner.plan(profile, nodes, Settings(ctx=8192))
    assert result["fits"]
    names = [p["llama_device"] for p in result["placements"]]
    assert names[0] == "CPU"
    assert any(n.startswith("RPC") for n in names)
    rpc = [p for p in result["placements"] if p["endpoint"]]
    args = result["llama_server_args"]
    assert args[args.index("--rpc") + 1] == ",".join(p["endpoint"] for p in rpc)
    assert args.index("--rpc") < args.index("--device")
    assert [p["llama_device"] for p in rpc] == [f"RPC{i}" for i in range(len(rpc))]
    assert_args_reproduce_placements(result)


def test_pipeline_parallel_compute_buffers_four_copies_on_a_gpu_one_and_input_copies_on_a_cpu_worker():
    # A coordinator CPU too slow to be worth a block: every block goes to the GPU and the worker.
    profile = make_profile(n_layer=8, block_mib=100)
    nodes = cluster(
        [dev("desk", "CPU", 1.0, 1), dev("desk", "CUDA0", 1.2, 900, kind="cuda")],
        ("pc", [dev("pc", "CPU", 8, 60)], 0.1),
    )
    cfg = Settings(ctx=1024, margin_fraction=0)
    result = planner.plan(profile, nodes, cfg)
    assert result["fits"] and result["pipeline_parallel"]
    assert result["placements"][0]["layers"] == 0
    by_device = {(p["node"], p["device"]): p for p in result["placements"]}
    gpu, worker = by_device[("desk", "CUDA0")], by_device[("pc", "CPU")]

    def one(placement: dict, pipeline: bool) -> int:
        output, layers = placement["output_layer"], placement["layers"]
        role = ("tail" if layers <= 1 else "out") if output else "mid"
        return planner.compute_bytes(profile, cfg, role=role, coordinator_cpu=False, pipeline=pipeline)

    # A GPU allocates all four copies llama.cpp reserves ...
    assert gpu["compute_bytes"] == 4 * one(gpu, True)
    # ... a CPU worker (an rpc-server's malloc) holds what it writes: one copy of the graph and four of its
    # split's inputs (tests/planning/test_rpc_memory_lab.py measures it).
    inputs = planner.input_copy_bytes(profile, cfg)
    assert worker["compute_bytes"] == one(worker, False) + 3 * inputs
    assert inputs == 512 * (3 * 4 * 4096 + 2 * 1024 + 16)


def test_does_not_fit_says_by_how_much_and_each_suggestion_really_fits():
    profile = make_profile(n_layer=32, block_mib=400, n_kv=32)
    nodes = cluster(
        [dev("desk", "CPU", 10, 40)], ("mac", [dev("mac", "MTL0", 16, 400, kind="metal", unified=True)], 0.5)
    )
    cfg = Settings(ctx=16384, parallel=2)
    result = planner.plan(profile, nodes, cfg)
    assert result["fits"] is False
    assert result["placements"] == [] and result["llama_server_args"] == []
    assert result["shortfall_bytes"] > 0
    changes = {s["change"]: s for s in result["suggestions"]}
    assert {"ctx", "cache_type", "add_node"} <= set(changes)
    for s in result["suggestions"]:
        assert s["fits"] is True
        assert s["predicted_tokens_per_s"] > 0
    # The largest context that fits, up to the one the model was trained for (8192), never past it.
    suggested, trained = changes["ctx"]["value"], profile["context_length"]
    assert suggested <= trained and suggested % 256 == 0
    bigger = planner.Settings(ctx=suggested + 256, parallel=2)
    assert suggested == trained or not planner.plan(profile, nodes, bigger)["fits"]


def test_a_suggested_context_never_exceeds_the_trained_one():
    """A model trained for 8192 that fits at 8192 but not at a million: the suggestion is 8192, though far
    longer contexts would fit too."""
    profile = make_profile(n_layer=8, block_mib=10, n_kv=8)
    nodes = cluster([dev("desk", "CPU", 4, 40)])
    assert planner.plan(profile, nodes, Settings(ctx=65536))["fits"]
    result = planner.plan(profile, nodes, Settings(ctx=1_048_576))
    assert not result["fits"]
    ctx = [s for s in result["suggestions"] if s["change"] == "ctx"]
    assert [s["value"] for s in ctx] == [8192] and ctx[0]["text"] == "A context of 8192 tokens fits."


def test_baseline_splits_proportionally_to_free_memory():
    profile = make_profile(n_layer=30, block_mib=100)
    nodes = cluster(
        [dev("desk", "CPU", 64, 50)],
        ("a", [dev("a", "CPU", 32, 20)], 0.5),
        ("b", [dev("b", "CPU", 64, 80)], 0.5),
    )
    result = planner.plan(profile, nodes, Settings(ctx=2048))
    base = result["baseline"]["placements"]
    assert [p["llama_device"] for p in base] == ["CPU", "RPC0", "RPC1"]
    assert base[0]["layers"] == 0
    # 31 slots (30 blocks + output) split 1:2 by llama.cpp's rule: 11, then 19 blocks and the output.
    assert base[1]["layers"] == 11 and base[2]["layers"] == 19 and base[2]["output_layer"]
    assert result["predicted_tokens_per_s"] >= result["baseline"]["predicted_tokens_per_s"]


def test_kv_cache_sizes_follow_llamacpp():
    profile = make_profile(n_layer=2, n_kv=2)
    profile["key_length"] = profile["value_length"] = [32, 32]
    # Measured with llama-server: -c 1000 -np 2 -ctk q8_0 gives 1024 cells and 0.133 MiB per layer.
    assert planner.kv_cells(Settings(ctx=1000, parallel=2)) == (512, 1024)
    assert (
        planner.kv_bytes_per_block(profile, Settings(ctx=1000, parallel=2, cache_type="q8_0")) == [139264] * 2
    )
    assert planner.kv_bytes_per_block(profile, Settings(ctx=1024)) == [262144] * 2


def test_layer_assignment_is_llamacpps():
    # -ngl 7 -ts 3,4 on 8 blocks: blocks 0-1 on the CPU, 2-4 on device 0, 5-7 and the output on device 1.
    assert layer_assignment([3, 4], 8, 7) == [-1, -1, 0, 0, 0, 1, 1, 1, 1]
    assert layer_assignment([], 4, 0) == [-1] * 5


def test_more_than_fifteen_devices_is_rejected():
    remotes = [(f"n{i}", [dev(f"n{i}", "CPU", 8, 20)], 1.0) for i in range(16)]
    with pytest.raises(planner.ClusterError, match="at most 15"):
        planner.build_problem(make_profile(), cluster([dev("desk", "CPU", 8, 20)], *remotes), Settings())


def test_cluster_file_errors_name_the_problem():
    with pytest.raises(planner.ClusterError, match="coordinator"):
        planner.cluster_from_dict({"nodes": [{"name": "a", "devices": []}]})
    with pytest.raises(planner.ClusterError, match="total_mib"):
        planner.cluster_from_dict(
            {"nodes": [{"name": "a", "coordinator": True, "devices": [{"name": "CPU"}]}]}
        )
