"""An integrated GPU (an Intel iGPU under Vulkan) shares the system's RAM: the probe lists it as that one
memory, and the planner counts it once, as it does Apple's unified memory (planning/unified_memory.py)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from nodes.models import Node, Transport
from nodes.pool import planner_nodes
from nodes.probe import parse as probe
from nodes.probe.collect import apply_probe_report
from planning import planner
from planning.planner import Settings
from tests.planning.profiles import make_profile
from tests.probe_reports import recorded


def mini_pc_report() -> probe.ProbeReport:
    """The recorded Debian probe with the recorded `vulkaninfo --summary` of an Iris Xe laptop chip."""
    extra = f"@@@ vulkaninfo\n{recorded('vulkaninfo_summary_intel_iris_xe.txt')}\n"
    text = recorded("linux_debian12_x86_64.txt").replace("@@@ rocm-smi\n", "@@@ rocm-smi\n\n" + extra, 1)
    return probe.build_report(text, rpc_port=50052)


def stored(report: probe.ProbeReport, name: str, *, coordinator: bool = False) -> Node:
    node = Node.objects.create(
        name=name, address=f"192.168.1.{Node.objects.count() + 20}", transport=Transport.SSH,
        may_coordinate=coordinator, rtt_ms=0.6,
    )  # fmt: skip
    apply_probe_report(node, report)
    node.last_seen_at = timezone.now()
    return node


@pytest.mark.django_db
def test_a_mini_pc_worker_offers_its_ram_once_through_its_integrated_gpu():
    desk = stored(
        probe.build_report(recorded("linux_debian12_x86_64.txt"), rpc_port=50052), "desk", coordinator=True
    )
    report = mini_pc_report()
    mini = stored(report, "mini")
    assert [(d.name, d.unified_memory) for d in mini.devices.all()] == [("Vulkan0", True)]
    profile = make_profile(n_layer=60, block_mib=500)  # about 30 GiB: more than the desk holds alone
    result = planner.plan(profile, planner_nodes([mini], desk), Settings(ctx=4096))
    on_mini = [p for p in result["placements"] if p["node"] == "mini"]
    [vulkan] = on_mini  # no CPU of the mini-PC beside it: that would be the same RAM twice
    assert vulkan["device"] == "Vulkan0" and vulkan["endpoint"] == f"{mini.address}:50052"
    # Like a Mac's memory, at most the clamp's share of it (the system and its programs keep the rest).
    assert (vulkan["limit_bytes"], vulkan["limit_basis"]) == (int(0.70 * report.ram_total_bytes), "clamp")
    assert vulkan["used_bytes"] <= vulkan["capacity_bytes"] <= report.ram_available_bytes


@pytest.mark.django_db
def test_a_mini_pc_coordinating_alone_shares_one_pool_between_its_cpu_and_its_gpu():
    report = mini_pc_report()
    mini = stored(report, "mini", coordinator=True)
    profile = make_profile(n_layer=16, block_mib=400, output_mib=400)  # about 7 GiB
    result = planner.plan(profile, planner_nodes([], mini), Settings(ctx=4096))
    assert result["fits"], result["warnings"]
    cpu, vulkan = result["placements"]
    assert (cpu["llama_device"], cpu["in_unified_pool"]) == ("CPU", True)
    assert (vulkan["llama_device"], vulkan["in_unified_pool"]) == ("Vulkan0", True)
    pool = result["unified_pool"]
    assert cpu["used_bytes"] + vulkan["used_bytes"] == pool["used_bytes"] <= pool["capacity_bytes"]
    assert pool["limit_bytes"] <= report.ram_total_bytes * 0.70
