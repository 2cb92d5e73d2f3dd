"""Stacked memory bars: the plan page's per-device and pool-wide bars (this plan beside llama.cpp's default
split) and the dashboard's device gauges (what each running deployment holds).

Pure functions over plan dicts (planning/planner.py) and plain numbers; the templates only draw what
these return. Widths are whole percents carried as CSS classes (`p0`…`p100`, static/css/bars.css), so no
page needs a `style=` attribute: a segment that holds anything is at least 1% wide, so a small model's
share stays visible, and every segment also has a label with its exact size and share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from llamacpp.logs import placement_key
from planning.placement import blocks_text

# The order and names of a plan bar's segments (and their CSS classes).
PLAN_PARTS = (("weights", "weights"), ("kv", "KV cache"), ("compute", "compute buffer"))
# Deployments on one device take these colours in turn (CSS classes d0…d5).
DEPLOYMENT_COLOURS = 6


def width_class(part: float, whole: float) -> str:
    """The CSS class of a segment `part` of `whole` wide: p0…p100; anything above 0 is at least p1."""
    if whole <= 0 or part <= 0:
        return "p0"
    share = min(100.0, part * 100.0 / whole)
    return f"p{max(1, min(100, math.floor(share + 0.5)))}"


def share_text(part: float, whole: float) -> str:
    """A share as people read it: "37%", "4.2%", "<0.1%", "0%"."""
    if whole <= 0 or part <= 0:
        return "0%"
    share = part * 100.0 / whole
    if share < 0.1:
        return "<0.1%"
    if share < 10:
        return f"{share:.1f}%"
    return f"{share:.0f}%"


@dataclass
class Segment:
    kind: str  # CSS class: weights, kv, compute, others, free, d0…d5
    label: str
    bytes: int
    share: str = ""
    width: str = "p0"
    url: str = ""


@dataclass
class Bar:
    """One stacked bar: segments that add up to `scale_bytes` (the device's memory, or more when over)."""

    title: str
    total_bytes: int
    segments: list[Segment] = field(default_factory=list)
    used_bytes: int = 0
    limit_bytes: int | None = None
    limit_at: str = ""  # CSS class of the limit marker's position (at0…at100), "" for none
    over: bool = False  # uses more than the device has (a split that runs out of memory)
    empty: bool = False  # holds nothing in this split

    @property
    def visible_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.bytes > 0]


def stacked_bar(
    title: str,
    total_bytes: int,
    parts: Iterable[tuple[str, str, int]],
    *,
    others_bytes: int = 0,
    limit_bytes: int | None = None,
) -> Bar:
    """A bar of `parts` ((css kind, label, bytes)), then memory in use by others, then what is free.

    Percentages are of the device's memory (`total_bytes`); a bar whose parts need more than that is drawn
    at the scale of what they need, marked `over`, with no free segment."""
    parts = [(kind, label, max(0, int(n))) for kind, label, n in parts]
    used = sum(n for _, _, n in parts)
    others = max(0, min(int(others_bytes), int(total_bytes) - used))
    total = max(0, int(total_bytes))
    scale = max(total, used + others)
    segments = [Segment(kind, label, n) for kind, label, n in parts]
    if others:
        segments.append(Segment("others", "in use by other programs", others))
    free = max(0, total - used - others)
    segments.append(Segment("free", "free", free))
    for seg in segments:
        seg.share = share_text(seg.bytes, total or scale)
        seg.width = width_class(seg.bytes, scale)
    _fit_widths(segments)
    limit_at = ""
    if limit_bytes is not None and scale > 0 and 0 < limit_bytes < scale:
        limit_at = "at" + width_class(limit_bytes, scale)[1:]
    return Bar(
        title=title,
        total_bytes=total,
        segments=segments,
        used_bytes=used,
        limit_bytes=limit_bytes,
        limit_at=limit_at,
        over=used + others > total,
        empty=used == 0,
    )


def _fit_widths(segments: list[Segment]) -> None:
    """Rounding (and the 1% floor) can add up past 100: take the excess from the widest segment."""
    widths = [int(s.width[1:]) for s in segments]
    excess = sum(widths) - 100
    if excess > 0:
        widest = max(range(len(widths)), key=lambda i: widths[i])
        widths[widest] = max(0, widths[widest] - excess)
        segments[widest].width = f"p{widths[widest]}"


# ---------------------------------------------------------------------------------------------------------
# The plan page


def _plan_parts(placement: dict) -> list[tuple[str, str, int]]:
    return [(kind, label, int(placement.get(f"{kind}_bytes") or 0)) for kind, label in PLAN_PARTS]


def _device_bar(title: str, placement: dict | None, device: dict) -> Bar:
    others = max(0, int(device["total_bytes"]) - int(device["free_bytes"]))
    if placement is None:
        return stacked_bar(title, device["total_bytes"], [], others_bytes=others)
    return stacked_bar(
        title,
        device["total_bytes"],
        _plan_parts(placement),
        others_bytes=others,
        limit_bytes=placement.get("limit_bytes"),
    )


def plan_bars(plan: dict) -> dict:
    """{"devices": [{"key", "node", "device", "placement", "baseline", "experts", "plan": Bar,
    "default": Bar}],
    "pool": {"plan": Bar, "default": Bar}}: the placements are the two splits' dicts (None when unused).

    Every device either split uses, in this plan's order then the default's; the pool bar adds them all up
    (a Mac's CPU and GPU share one memory: counted once)."""
    mine = {(p["node"], p["device"]): p for p in plan.get("placements") or []}
    theirs = {(p["node"], p["device"]): p for p in (plan.get("baseline") or {}).get("placements") or []}
    keys = list(mine) + [k for k in theirs if k not in mine]
    devices = []
    for key in keys:
        info = mine.get(key) or theirs[key]
        device = {"total_bytes": int(info.get("total_bytes") or 0), "free_bytes": _free(info)}
        devices.append(
            {
                "key": f"{key[0]}/{key[1]}",
                "node": key[0],
                "device": key[1],
                "placement": mine.get(key),
                "baseline": theirs.get(key),
                # Whose routed experts it holds, when the plan places a mixture of experts' experts apart.
                "experts": blocks_text((mine.get(key) or {}).get("expert_blocks") or []),
                "plan": _device_bar("This plan", mine.get(key), device),
                "default": _device_bar("llama.cpp's default", theirs.get(key), device),
            }
        )
    pool = {
        "plan": _pool_bar("This plan", mine, theirs, keys),
        "default": _pool_bar("llama.cpp's default", theirs, mine, keys),
    }
    return {"devices": devices, "pool": pool}


def _free(info: dict) -> int:
    total, free = int(info.get("total_bytes") or 0), info.get("free_bytes")
    return total if free is None else min(total, int(free))


def _pool_bar(title: str, split: dict, other: dict, keys: list) -> Bar:
    total = others = 0
    counted_pools: set[str] = set()
    sums = {kind: 0 for kind, _ in PLAN_PARTS}
    for key in keys:
        info = split.get(key) or other[key]
        if info.get("in_unified_pool"):
            # CPU and GPU of one Mac: one memory, counted once.
            if key[0] in counted_pools:
                info_total = 0
            else:
                counted_pools.add(key[0])
                info_total = int(info.get("total_bytes") or 0)
        else:
            info_total = int(info.get("total_bytes") or 0)
        total += info_total
        if info_total:
            others += max(0, info_total - _free(info))
        if key in split:
            for kind, _ in PLAN_PARTS:
                sums[kind] += int(split[key].get(f"{kind}_bytes") or 0)
    parts = [(kind, label, sums[kind]) for kind, label in PLAN_PARTS]
    return stacked_bar(title, total, parts, others_bytes=others)


# ---------------------------------------------------------------------------------------------------------
# The dashboard


def held_bytes(deployment, placement: dict) -> int:
    """What a deployment holds on one placement's device: what llama.cpp reported allocating there (weights,
    KV cache and compute buffers, read from its log by the verify step) once it has been verified, else what
    the plan expected."""
    verified = (getattr(deployment, "verification", None) or {}).get("devices") or {}
    logged = verified.get(placement_key(placement)) if verified else None
    if logged:
        total = sum(int(logged.get(k) or 0) for k in ("logged_weights", "logged_kv", "logged_compute"))
        if total:
            return total
    return int(placement.get("used_bytes") or 0)


def released_nodes(deployment) -> set[str]:
    """The nodes where the deployment's processes have ended (the monitor found them gone): it holds no
    memory there any more, though it has not been stopped."""
    gone = getattr(deployment, "gone_processes", None)
    return {row["node"] for row in gone()} if gone else set()


def device_gauges(nodes: Iterable, deployments: Iterable) -> list[dict]:
    """For each node, its devices as gauges: what each active deployment holds on it (`held_bytes`; nothing
    on a node where its processes have ended), what other programs used at the last probe, the rest free.

    Other programs' share is the memory the last probe found in use less what the deployments whose
    processes had started by then held (the probe saw them too); what a deployment released since (it
    crashed) is free again, what one took since is no longer free. `nodes` are Node rows with their devices
    prefetched; `deployments` active Deployment rows. Returns
    [{"node": Node, "devices": [{"device": Device, "bar": Bar}]}]."""
    holding: dict[tuple[str, str], list[tuple[object, int]]] = {}
    at_probe: dict[tuple[str, str], list[tuple[object, int]]] = {}
    colours: dict[int, str] = {}
    for deployment in deployments:
        colours.setdefault(deployment.pk, f"d{len(colours) % DEPLOYMENT_COLOURS}")
        released = released_nodes(deployment)
        for p in (deployment.plan or {}).get("placements") or []:
            used = held_bytes(deployment, p)
            if used:
                at_probe.setdefault((p["node"], p["device"]), []).append((deployment, used))
            if used and p["node"] not in released:
                holding.setdefault((p["node"], p["device"]), []).append((deployment, used))
    out = []
    for node in nodes:
        rows = []
        for device in node.devices.all():
            held = holding.get((node.name, device.name), [])
            parts = [(colours[d.pk], d.name, used) for d, used in held]
            others = _others_at_probe(node, device, at_probe.get((node.name, device.name), []))
            bar = stacked_bar(f"{node.name} / {device.name}", device.total_bytes, parts, others_bytes=others)
            for seg, (d, _) in zip(bar.segments, held, strict=False):
                seg.url = d.get_absolute_url()
            rows.append({"device": device, "bar": bar})
        out.append({"node": node, "devices": rows})
    return out


def _others_at_probe(node, device, holders: list[tuple[object, int]]) -> int:
    """What programs other than the deployments used on `device` when the node was last probed."""
    probed_free = getattr(device, "free_bytes", None)
    probed_at = getattr(node, "last_seen_at", None)
    if probed_free is None:
        return 0
    in_use = max(0, int(device.total_bytes) - int(probed_free))
    ours = sum(
        used
        for deployment, used in holders
        if probed_at is not None
        and getattr(deployment, "started_at", None) is not None
        and deployment.started_at <= probed_at
    )
    return max(0, in_use - ours)


def gauge_totals(gauges: list[dict]) -> dict:
    """The pool's memory as the gauges draw it: {"total", "free", "devices"} (the dashboard's tile says
    the same numbers as its bars)."""
    bars = [row["bar"] for gauge in gauges for row in gauge["devices"]]
    free = sum(seg.bytes for bar in bars for seg in bar.segments if seg.kind == "free")
    return {"total": sum(bar.total_bytes for bar in bars), "free": free, "devices": len(bars)}
