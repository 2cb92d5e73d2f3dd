"""Apple Silicon, from recorded probe outputs of M1, M2 Pro, M3 Max and M4 Pro Macs (tests/data/probe/macos_*)
through the stored devices to the plan.

Unified memory is clamped once, in the planner: the probe stores the raw memory and the wired limit, and
a plan may use min(wired limit if set, clamp x RAM). A Mac can coordinate: its CPU and MTL0 share one pool.
"""

from __future__ import annotations

import pytest
from django.utils import timezone

from nodes.models import Node, Transport
from nodes.pool import planner_nodes
from nodes.probe import bandwidth
from nodes.probe.collect import apply_probe_report
from nodes.probe.parse import parse_wired_limit
from planning import planner
from planning.planner import GIB, MIB, Settings
from tests.planning.profiles import make_profile
from tests.probe_reports import report_of

# file, chip, RAM GiB, CPU cores, GPU cores, wired limit (bytes) or None
MACS = [
    pytest.param("macos_m1_8gb_ventura.txt", "Apple M1", 8, 8, 7, None, id="M1-8GB-macOS13"),
    pytest.param("macos_m1_16gb.txt", "Apple M1", 16, 8, 8, None, id="M1-16GB"),
    pytest.param("macos_m2_pro_16gb.txt", "Apple M2 Pro", 16, 10, 16, None, id="M2Pro-16GB"),
    pytest.param("macos_m2_pro.txt", "Apple M2 Pro", 32, 12, 19, None, id="M2Pro-32GB"),
    pytest.param("macos_m2_pro_wired_limit.txt", "Apple M2 Pro", 32, 12, 19, 28 * GIB, id="M2Pro-32GB-wired"),
    pytest.param("macos_m3_max_36gb.txt", "Apple M3 Max", 36, 14, 30, None, id="M3Max-36GB"),
    pytest.param("macos_m3_max_48gb.txt", "Apple M3 Max", 48, 16, 40, None, id="M3Max-48GB"),
    pytest.param("macos_m3_max_64gb.txt", "Apple M3 Max", 64, 16, 40, None, id="M3Max-64GB"),
    pytest.param("macos_m3_max_128gb_wired_limit.txt", "Apple M3 Max", 128, 16, 40, 120 * GIB,
                 id="M3Max-128GB-wired"),
    pytest.param("macos_m4_pro_24gb.txt", "Apple M4 Pro", 24, 12, 16, None, id="M4Pro-24GB"),
    pytest.param("macos_m4_pro_48gb.txt", "Apple M4 Pro", 48, 14, 20, None, id="M4Pro-48GB"),
    pytest.param("macos_m4_pro_64gb.txt", "Apple M4 Pro", 64, 14, 20, None, id="M4Pro-64GB"),
]  # fmt: skip


def usable(ram: int, wired: int | None, clamp: float) -> int:
    """The issue's rule, written out independently of the planner."""
    share = int(clamp * ram)
    return min(wired, share) if wired else share


@pytest.mark.parametrize(("recording", "chip", "gib", "cores", "gpu_cores", "wired"), MACS)
def test_a_recorded_mac_is_one_metal_device_with_raw_memory_and_its_wired_limit(
    recording, chip, gib, cores, gpu_cores, wired
):
    report = report_of(recording)
    assert (report.platform, report.arch) == ("macos", "arm64")
    assert (report.cpu_model, report.cpu_cores, report.ram_total_bytes) == (chip, cores, gib * GIB)
    assert 0 < report.ram_available_bytes < report.ram_total_bytes
    assert not any("ended early" in w for w in report.warnings)
    [metal] = report.devices
    assert (metal.name, metal.kind, metal.unified_memory) == ("MTL0", "metal", True)
    assert metal.total_bytes == metal.free_bytes == gib * GIB
    assert metal.wired_limit_bytes == wired
    assert metal.description == f"{chip} ({gpu_cores}-core GPU)"
    assert metal.bandwidth_gbs == bandwidth.apple_bandwidth(chip) > 0


def test_macos_13_names_the_wired_limit_differently_and_counts_bytes():
    assert report_of("macos_m1_8gb_ventura.txt").os_name == "macOS 13.6.7"
    assert parse_wired_limit({"debug.iogpu.wired_limit": str(6 * GIB)}) == 6 * GIB
    assert parse_wired_limit({"iogpu.wired_limit_mb": "6144"}) == 6 * GIB
    assert parse_wired_limit({"iogpu.wired_limit_mb": "0", "debug.iogpu.wired_limit": "0"}) is None


# -- stored and planned --------------------------------------------------------------------------------------


def stored(recording: str, name: str, *, coordinator: bool = False) -> Node:
    node = Node.objects.create(
        name=name, address=f"192.168.1.{Node.objects.count() + 20}", transport=Transport.SSH,
        may_coordinate=coordinator, rtt_ms=0.6,
    )  # fmt: skip
    apply_probe_report(node, report_of(recording))
    node.last_seen_at = timezone.now()
    return node


def plan_on(nodes: list[Node], coordinator: Node, profile: dict, settings: Settings) -> dict:
    others = [n for n in nodes if n.pk != coordinator.pk]
    return planner.plan(profile, planner_nodes(others, coordinator), settings)


def mtl0(plan: dict) -> dict:
    return next(p for p in plan["placements"] if p["device"] == "MTL0")


@pytest.mark.django_db
def test_a_32_gib_mac_is_planned_at_70_percent_not_49():
    desk = stored("linux_debian12_x86_64.txt", "desk", coordinator=True)
    mac = stored("macos_m2_pro.txt", "mac")
    # 64 blocks of 500 MiB: far more than the Mac holds, so the plan fills it to its limit.
    result = plan_on([desk, mac], desk, make_profile(n_layer=64, block_mib=500), Settings(ctx=4096))
    metal = mtl0(result)
    assert metal["limit_bytes"] == int(0.70 * 32 * GIB)  # 22.4 GiB
    assert metal["limit_basis"] == "clamp"
    assert metal["capacity_bytes"] == int(metal["limit_bytes"] * 0.97)
    # Filled well past the old double clamp (0.70 x 0.70 = 49%, 15.7 GiB), never past the limit.
    assert 0.49 * 32 * GIB < metal["used_bytes"] <= metal["capacity_bytes"]
    block = 500 * MIB + planner.kv_bytes_per_block(make_profile(), Settings(ctx=4096))[0]
    assert metal["used_bytes"] + block > metal["capacity_bytes"]  # one more block would not fit


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("recording", "clamp", "limit", "basis"),
    [
        ("macos_m3_max_128gb_wired_limit.txt", 0.70, int(0.70 * 128 * GIB), "clamp"),
        ("macos_m3_max_128gb_wired_limit.txt", 1.0, 120 * GIB, "wired_limit"),
        ("macos_m2_pro_wired_limit.txt", 0.85, int(0.85 * 32 * GIB), "clamp"),
        ("macos_m2_pro_wired_limit.txt", 0.9, 28 * GIB, "wired_limit"),
        ("macos_m2_pro.txt", 0.9, int(0.9 * 32 * GIB), "clamp"),
    ],
)
def test_the_usable_share_is_the_lower_of_the_wired_limit_and_the_clamp(recording, clamp, limit, basis):
    desk = stored("linux_debian12_x86_64.txt", "desk", coordinator=True)
    mac = stored(recording, "mac")
    # About 30 GiB: more than the desk holds, so the Mac takes part.
    profile = make_profile(n_layer=60, block_mib=500)
    result = plan_on([desk, mac], desk, profile, Settings(ctx=4096, clamp=clamp))
    metal = mtl0(result)
    assert (metal["limit_bytes"], metal["limit_basis"]) == (limit, basis)
    assert metal["used_bytes"] <= metal["capacity_bytes"] < limit


@pytest.mark.django_db
@pytest.mark.parametrize(("recording", "chip", "gib", "cores", "gpu_cores", "wired"), MACS)
def test_every_recorded_mac_coordinates_alone_on_one_pool(recording, chip, gib, cores, gpu_cores, wired):
    mac = stored(recording, "mac", coordinator=True)
    # A model of about half the Mac's memory: 16 blocks, the input embedding and the output layer.
    block_mib = gib * 1024 * 0.5 / 18
    profile = make_profile(n_layer=16, block_mib=block_mib, output_mib=block_mib)
    result = plan_on([mac], mac, profile, Settings(ctx=4096))
    assert result["fits"], result["warnings"]
    cpu, metal = result["placements"]
    assert (cpu["llama_device"], cpu["limit_basis"], cpu["in_unified_pool"]) == ("CPU", "pool", True)
    assert (metal["llama_device"], metal["endpoint"], metal["in_unified_pool"]) == ("MTL0", None, True)
    args = result["llama_server_args"]
    assert args[args.index("--device") + 1] == "MTL0" and "--rpc" not in args
    assert metal["layers"] == 16 and metal["output_layer"]  # the GPU is faster than the CPU: all of it
    assert cpu["weights_bytes"] >= profile["input_embedding_bytes"]  # token_embd stays in the CPU's RAM
    pool = result["unified_pool"]
    assert pool["limit_bytes"] == int(0.70 * gib * GIB)  # CPU and GPU together: the clamp, not more
    assert cpu["used_bytes"] + metal["used_bytes"] == pool["used_bytes"] <= pool["capacity_bytes"]
    assert metal["limit_bytes"] == usable(gib * GIB, wired, 0.70)


@pytest.mark.django_db
def test_a_mac_coordinator_whose_gpu_is_capped_by_its_wired_limit_puts_blocks_on_its_cpu_within_the_pool():
    # M2 Pro 32 GB, wired limit 28 GiB, clamp 1.0: Metal may use 28 GiB, the Mac 32 GiB in all.
    mac = stored("macos_m2_pro_wired_limit.txt", "mac", coordinator=True)
    profile = make_profile(n_layer=56, block_mib=500, output_mib=400)  # about 28.5 GiB
    result = plan_on([mac], mac, profile, Settings(ctx=2048, clamp=1.0))
    assert result["fits"]
    cpu, metal = result["placements"]
    assert metal["limit_bytes"] == 28 * GIB and metal["limit_basis"] == "wired_limit"
    assert metal["used_bytes"] <= metal["capacity_bytes"]
    assert cpu["layers"] > 0  # what Metal may not hold, the CPU holds, from the same memory
    pool = result["unified_pool"]
    assert pool["limit_bytes"] == 32 * GIB
    assert cpu["used_bytes"] + metal["used_bytes"] <= pool["capacity_bytes"]
    # Not a byte more: with the clamp at 0.9 the pool is 28.8 GiB and the same model no longer fits.
    assert not plan_on([mac], mac, profile, Settings(ctx=2048, clamp=0.9))["fits"]


@pytest.mark.django_db
def test_a_mac_coordinates_a_pc_with_a_gpu_from_their_recorded_probes():
    mac = stored("macos_m4_pro_64gb.txt", "mac", coordinator=True)
    pc = stored("linux_ubuntu_rtx3090.txt", "pc")
    profile = make_profile(n_layer=80, block_mib=500, output_mib=800)  # about 40 GiB
    result = plan_on([mac, pc], mac, profile, Settings(ctx=8192))
    assert result["fits"] and result["coordinator"] == "mac"
    used = {p["llama_device"]: p for p in result["placements"]}
    assert {"CPU", "MTL0", "RPC0"} <= set(used)
    assert used["RPC0"]["endpoint"] == f"{pc.address}:50052"
    pool = result["unified_pool"]
    assert used["CPU"]["used_bytes"] + used["MTL0"]["used_bytes"] <= pool["capacity_bytes"]
    assert pool["capacity_bytes"] <= 0.70 * 64 * GIB


# -- rows stored before the planner clamped once -------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_stored_metal_rows_are_rewritten_to_raw_memory_so_they_are_clamped_exactly_once():
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before, after = [("nodes", "0002_build")], [("nodes", "0003_device_wired_limit_raw_unified_memory")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    ram = 32 * GIB
    rows = {}
    # What the old probe stored: 0.70 x RAM by default, the wired limit when one was set, or the share of a
    # clamp an operator had changed through RAMDECK_UNIFIED_MEMORY_CLAMP.
    for name, share in (("default", int(ram * 0.70)), ("wired", 28 * GIB), ("clamp80", int(ram * 0.80))):
        node = old.get_model("nodes", "Node").objects.create(
            name=name, address="10.0.0.9", facts={"ram_total_bytes": ram}
        )
        rows[name] = old.get_model("nodes", "Device").objects.create(
            node=node, name="MTL0", kind="metal", total_bytes=share, free_bytes=share, unified_memory=True
        )
    no_facts = old.get_model("nodes", "Node").objects.create(name="nofacts", address="10.0.0.8")
    rows["nofacts"] = old.get_model("nodes", "Device").objects.create(
        node=no_facts, name="MTL0", kind="metal", total_bytes=int(16 * GIB * 0.70),
        free_bytes=int(16 * GIB * 0.70), unified_memory=True,
    )  # fmt: skip
    cpu_box = old.get_model("nodes", "Node").objects.create(name="pc", address="10.0.0.7")
    cpu = old.get_model("nodes", "Device").objects.create(
        node=cpu_box, name="CPU", kind="cpu", total_bytes=8 * GIB, free_bytes=6 * GIB
    )
    executor = MigrationExecutor(connection)
    executor.migrate(after)
    new = executor.loader.project_state(after).apps.get_model("nodes", "Device")

    def planned(name: str, clamp: float = 0.70) -> int:
        d = new.objects.get(pk=rows[name].pk)
        device = planner.Device(
            name, "MTL0", "metal", d.total_bytes, d.free_bytes, 400, True, d.wired_limit_bytes or 0
        )
        return planner.capacity_bytes(device, Settings(clamp=clamp))[0]

    assert new.objects.get(pk=rows["default"].pk).total_bytes == ram
    assert planned("default") == int(ram * 0.70)  # once, not 0.70 x 0.70
    assert planned("default", clamp=0.9) == int(ram * 0.90)  # and the form's clamp takes effect
    assert new.objects.get(pk=rows["wired"].pk).wired_limit_bytes == 28 * GIB
    assert planned("wired", clamp=1.0) == 28 * GIB
    assert planned("clamp80", clamp=0.70) == int(ram * 0.70)
    assert planned("clamp80", clamp=1.0) == int(ram * 0.80)  # never above what was planned before
    assert new.objects.get(pk=rows["nofacts"].pk).total_bytes == round(int(16 * GIB * 0.70) / 0.70)
    assert abs(planned("nofacts") - int(16 * GIB * 0.70)) <= 1
    assert (new.objects.get(pk=cpu.pk).total_bytes, new.objects.get(pk=cpu.pk).free_bytes) == (
        8 * GIB,
        6 * GIB,
    )
    # Back and forth again: going back restores the old meaning.
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    back = executor.loader.project_state(before).apps.get_model("nodes", "Device")
    assert back.objects.get(pk=rows["default"].pk).total_bytes == int(ram * 0.70)
    assert back.objects.get(pk=rows["wired"].pk).total_bytes == 28 * GIB
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
