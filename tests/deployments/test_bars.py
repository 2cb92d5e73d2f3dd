"""The stacked memory bars and gauges (deployments/charts/bars.py): widths as classes, readable at any
size."""

from __future__ import annotations

from types import SimpleNamespace

from deployments.charts import bars

MIB = 1024 * 1024
GIB = 1024 * MIB


def widths(bar: bars.Bar) -> dict[str, int]:
    return {s.kind: int(s.width[1:]) for s in bar.segments}


def test_a_small_model_on_a_big_device_stays_visible_and_labelled():
    bar = bars.stacked_bar("This plan", 64 * GIB, [("weights", "weights", 9 * MIB), ("kv", "KV cache", MIB)])
    # 9 MiB of 64 GiB is 0.014%: drawn 1% wide (not 0), labelled with its true share.
    assert widths(bar) == {"weights": 1, "kv": 1, "free": 98}
    assert [s.share for s in bar.segments] == ["<0.1%", "<0.1%", "100%"]
    assert not bar.over and not bar.empty


def test_segments_are_percent_of_the_device_and_add_up_to_100():
    bar = bars.stacked_bar(
        "x", 10 * GIB, [("weights", "w", 6 * GIB), ("kv", "k", GIB), ("compute", "c", GIB // 2)],
        others_bytes=GIB, limit_bytes=9 * GIB,
    )  # fmt: skip
    assert widths(bar) == {"weights": 60, "kv": 10, "compute": 5, "others": 10, "free": 15}
    assert sum(widths(bar).values()) == 100
    assert bar.limit_at == "at90" and bar.segments[0].share == "60%"


def test_a_split_that_runs_out_of_memory_is_drawn_at_its_own_scale_and_marked_over():
    bar = bars.stacked_bar("default", 4 * GIB, [("weights", "w", 6 * GIB), ("kv", "k", 2 * GIB)])
    assert bar.over and widths(bar) == {"weights": 75, "kv": 25, "free": 0}
    assert bar.segments[0].share == "150%"  # of the device: more than it has


def test_rounding_never_adds_up_past_100():
    parts = [("weights", "w", 1), ("kv", "k", 1), ("compute", "c", 1)]
    bar = bars.stacked_bar("x", 1000, parts, others_bytes=996)
    assert sum(widths(bar).values()) <= 100 and all(w >= 1 for k, w in widths(bar).items() if k != "free")


def placement(node, device, weights, kv, compute, total, free=None, **extra):
    return {"node": node, "device": device, "weights_bytes": weights, "kv_bytes": kv,
            "compute_bytes": compute, "used_bytes": weights + kv + compute, "total_bytes": total,
            "free_bytes": total if free is None else free, "limit_bytes": total, **extra}  # fmt: skip


def test_plan_bars_show_both_splits_per_device_and_for_the_pool():
    plan = {
        "placements": [placement("desk", "CUDA0", 6 * GIB, GIB, GIB, 8 * GIB)],
        "baseline": {
            "placements": [
                placement("desk", "CUDA0", 3 * GIB, GIB // 2, GIB, 8 * GIB),
                placement("pc", "CPU", 3 * GIB, GIB // 2, GIB, 16 * GIB, free=12 * GIB),
            ]
        },
    }
    out = bars.plan_bars(plan)
    assert [d["key"] for d in out["devices"]] == ["desk/CUDA0", "pc/CPU"]
    pc = out["devices"][1]
    assert pc["placement"] is None and pc["plan"].empty and not pc["default"].empty
    assert widths(pc["plan"]) == {"others": 25, "free": 75}  # the plan leaves pc alone
    pool_plan, pool_default = out["pool"]["plan"], out["pool"]["default"]
    assert pool_plan.total_bytes == pool_default.total_bytes == 24 * GIB
    assert pool_plan.used_bytes == 8 * GIB and pool_default.used_bytes == 9 * GIB


def test_a_macs_cpu_and_gpu_count_once_in_the_pool():
    plan = {
        "placements": [
            placement("mac", "Metal", 4 * GIB, GIB, GIB, 32 * GIB, in_unified_pool=True),
            placement("mac", "CPU", GIB, 0, 0, 32 * GIB, in_unified_pool=True),
        ],
        "baseline": {"placements": []},
    }
    assert bars.plan_bars(plan)["pool"]["plan"].total_bytes == 32 * GIB


def test_device_gauges_show_what_each_running_deployment_holds():
    device = SimpleNamespace(name="CPU", total_bytes=16 * GIB)
    node = SimpleNamespace(name="pc", devices=SimpleNamespace(all=lambda: [device]))

    def deployment(pk, name, used):
        held = {"placements": [{"node": "pc", "device": "CPU", "used_bytes": used}]}
        return SimpleNamespace(pk=pk, name=name, get_absolute_url=lambda: f"/deployments/{pk}/", plan=held)

    gauges = bars.device_gauges([node], [deployment(1, "big", 8 * GIB), deployment(2, "small", 2 * GIB)])
    bar = gauges[0]["devices"][0]["bar"]
    assert [(s.kind, s.label, s.width, s.url) for s in bar.segments] == [
        ("d0", "big", "p49", "/deployments/1/"),  # 50, 12.5 and 37.5 round to 101: the widest gives 1
        ("d1", "small", "p13", "/deployments/2/"),
        ("free", "free", "p38", ""),
    ]
    assert bar.used_bytes == 10 * GIB and bar.segments[-1].bytes == 6 * GIB


def test_a_verified_deployment_shows_what_llama_cpp_allocated_not_what_was_planned():
    device = SimpleNamespace(name="CPU", total_bytes=16 * GIB)
    node = SimpleNamespace(name="pc", devices=SimpleNamespace(all=lambda: [device]))
    placement = {"node": "pc", "device": "CPU", "llama_device": "RPC0", "endpoint": "10.0.0.2:50052",
                 "used_bytes": 4 * GIB}  # fmt: skip
    logged = {"logged_weights": 3 * GIB, "logged_kv": GIB, "logged_compute": GIB}
    verified = SimpleNamespace(pk=1, name="verified", get_absolute_url=lambda: "/deployments/1/",
                               plan={"placements": [placement]},
                               verification={"devices": {"10.0.0.2:50052": logged}})  # fmt: skip
    launching = SimpleNamespace(pk=2, name="launching", get_absolute_url=lambda: "/deployments/2/",
                                plan={"placements": [placement]}, verification={})  # fmt: skip
    bar = bars.device_gauges([node], [verified, launching])[0]["devices"][0]["bar"]
    assert [(s.label, s.bytes) for s in bar.segments] == [
        ("verified", 5 * GIB),  # weights, KV cache and compute buffers as llama.cpp reported them
        ("launching", 4 * GIB),  # not verified yet: the plan's figure
        ("free", 7 * GIB),
    ]
