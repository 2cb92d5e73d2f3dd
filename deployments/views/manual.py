"""The plan page's split by hand: its form, the plan of the split it holds, and the rows the page compares.

The view that checks a split (`plan_manual`) and Confirm, which deploys one, are in deployments/views/plan.py;
the split itself is planning/manual.py's, priced with the planner's own model."""

from __future__ import annotations

from builds.offers import missing_device
from deployments.forms import ManualSplitForm
from modelfiles.models import ModelFile
from nodes.models import Node
from nodes.pool import planner_nodes, stale_calibration_warnings
from planning import manual, planner

# The form's prefix: its fields travel with Confirm's too (form="confirm-form"), beside the plan form's.
PREFIX = "manual"


def build_refusals(devices: list[manual.ManualDevice], rows: list[Node]) -> dict[int, str]:
    """Device index -> why its node's llama.cpp build cannot run it (builds/offers.py), for the devices a
    build does not offer (a node without a build, or whose build listed no devices, is Deploy's to refuse)."""
    nodes = {n.name: n for n in rows}
    builds: dict[str, object] = {}
    refusals = {}
    for k, d in enumerate(devices):
        node = nodes.get(d.node)
        if node is None or d.device == "CPU":
            continue
        if node.name not in builds:
            builds[node.name] = node.current_build
        build = builds[node.name]
        offered = build.offered_devices() if build is not None else None
        if offered is not None and d.device not in offered:
            refusals[k] = missing_device(node.name, d.device, d.kind, build)
    return refusals


def _initial(problem: planner.Problem, devices: list[manual.ManualDevice], placements: list[dict]) -> dict:
    """The counts of a plan's placements (the planner's, else llama.cpp's default), as the form's start."""
    by_device = {(p["node"], p["device"]): p for p in placements}
    moe = [bool(e) for e in problem.expert_bytes]
    # Experts placed apart: each placement lists the blocks whose experts it holds; else they are its own.
    apart = any(p.get("expert_blocks") for p in placements)
    initial = {"layout": ",".join(f"{d.node}/{d.device}" for d in devices)}
    for k, d in enumerate(devices):
        p = by_device.get((d.node, d.device)) or {}
        layers, first = int(p.get("layers") or 0), int(p.get("first_layer") or 0)
        initial[f"layers_{k}"] = layers
        held = (p.get("expert_blocks") or []) if apart else range(first, first + layers)
        initial[f"experts_{k}"] = sum(1 for b in held if moe[b])
    return initial


def manual_form_for(
    model: ModelFile, settings: planner.Settings, plan: dict | None, rows: list[Node], data=None
) -> ManualSplitForm | None:
    """The split-by-hand form for the page's plan (None when nothing was planned): bound to `data` when
    given, else starting from the planner's split."""
    if plan is None or not rows:
        return None
    try:
        problem = planner.build_problem(model.profile, planner_nodes(rows[1:], rows[0]), settings)
    except planner.ClusterError:
        return None
    placements = (
        plan["placements"] if plan.get("fits") else (plan.get("baseline") or {}).get("placements", [])
    )
    devices = manual.manual_devices(problem, [(p["node"], p["device"]) for p in placements])
    return ManualSplitForm(
        data,
        problem=problem,
        devices=devices,
        refusals=build_refusals(devices, rows),
        initial=_initial(problem, devices, placements),
        prefix=PREFIX,
    )


def manual_plan(model: ModelFile, form: ManualSplitForm, rows: list[Node]) -> dict:
    """The plan of a valid form's split: the planner's assembly (placements, llama.cpp's arguments, the
    baseline) for this split, marked as placed by hand."""
    problem = form.problem
    plan = planner.plan(model.profile, problem.nodes, problem.settings, split=form.split, problem=problem)
    plan["warnings"] += stale_calibration_warnings(rows)
    layers, experts = form.counts()
    plan["manual_counts"] = [
        {
            "node": d.node,
            "device": d.device,
            "layers": layers[k],
            **({"experts": experts[k]} if experts else {}),
        }
        for k, d in enumerate(form.devices)
    ]
    return plan


def comparison(form: ManualSplitForm, plan: dict, by_hand: dict | None) -> list[dict]:
    """Per device: the form's fields, and the planner's, llama.cpp's default's and the split by hand's blocks
    and memory on it, side by side."""

    def index(placements: list[dict]) -> dict:
        return {(p["node"], p["device"]): p for p in placements or []}

    planned = index(plan.get("placements") if plan.get("fits") else [])
    default = index((plan.get("baseline") or {}).get("placements"))
    mine = index(by_hand.get("placements") if by_hand else [])
    rows = []
    for row in form.rows():
        key = (row["device"].node, row["device"].device)
        rows.append(
            {**row, "planner": planned.get(key), "default": default.get(key), "by_hand": mine.get(key)}
        )
    return rows


def manual_context(model: ModelFile, settings, plan: dict | None, rows: list[Node], data=None) -> dict:
    """The page's context for the split by hand: its form, and when it was posted and holds a good split,
    that split's plan."""
    form = manual_form_for(model, settings, plan, rows, data)
    by_hand = (
        manual_plan(model, form, rows) if form is not None and form.is_bound and form.is_valid() else None
    )
    return {
        "manual_form": form,
        "manual_plan": by_hand,
        "manual_rows": comparison(form, plan, by_hand) if form is not None else [],
    }
