"""Model registry, "what runs on this pool", plan preview and confirmation, deployment list and detail.

The run of a deployment (deploy, stop, its live steps) is deployments/views/run.py."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib import messages
from django.db import IntegrityError, transaction
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from django_htmx.http import reswap

from audit import history
from builds.offers import plan_device_refusal
from deployments.charts import bars
from deployments.endpoint import EndpointForm, endpoint_form, port_taken
from deployments.forms import PlanForm
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from deployments.views.commands import command_lines
from deployments.views.manual import manual_context, manual_form_for, manual_plan
from jobs.models import may_use_local_node
from modelfiles.fit import default_context, default_coordinator, trained_context
from modelfiles.models import ModelFile
from nodes.models import Node
from nodes.pool import planner_nodes, pool_nodes, stale_calibration_warnings, tunnel_warnings
from planning import planner
from planning.first_word import DECODE_TIE
from ramdeck_site.roles import OPERATOR, VIEWER, can_administer, may_use, role_required

# Confirm's `then` for "Deploy this split": confirm the split by hand the page checked, and deploy it.
DEPLOY_BY_HAND = "deploy-by-hand"


def _get_model(pk: int) -> ModelFile:
    return get_object_or_404(ModelFile.objects.select_related("node"), pk=pk)


def _plan_form(request, model: ModelFile, data) -> PlanForm:
    """The plan form bound to the request's values, missing ones taken from the defaults.

    The page's own form sends a `full` marker: then an absent `nodes` means "no node ticked" rather than
    "not given", which defaults to the whole pool.
    """
    nodes_qs = Node.objects.filter(enabled=True).prefetch_related("devices")
    coordinators = nodes_qs.filter(may_coordinate=True)
    pool = pool_nodes()
    coordinator = default_coordinator(model, pool)
    data = data or {}
    bound = {
        # What the models list showed for it; planned only when the request does not say.
        "ctx": data.get("ctx") if "ctx" in data else default_context(model, pool),
        "parallel": 1,
        "cache_type": "f16",
        "clamp": settings.RAMDECK_UNIFIED_MEMORY_CLAMP,
        "coordinator": coordinator.pk if coordinator else "",
        "nodes": [n.pk for n in pool],
        "name": "",
        "beyond": "",
    }
    for key in bound:
        if key == "nodes":
            if "nodes" in data or "full" in data:
                bound["nodes"] = data.getlist("nodes") if hasattr(data, "getlist") else data.get("nodes", [])
        elif key in data:
            bound[key] = data.get(key)
    return PlanForm(
        bound,
        nodes_qs=nodes_qs,
        coordinators_qs=coordinators,
        trained_ctx=trained_context(model),
        may_go_beyond=can_administer(request.user),
    )


def plan_inputs(model: ModelFile, form: PlanForm) -> tuple[list[Node], str]:
    """The nodes a valid plan form plans on, the coordinator first, or ([], why not)."""
    coordinator = form.cleaned_data["coordinator"] or default_coordinator(model, pool_nodes())
    if coordinator is None:
        return [], "No node may coordinate: mark one as 'may coordinate' on its node page."
    return [coordinator, *[n for n in form.cleaned_data["nodes"] if n.pk != coordinator.pk]], ""


def _objective(data) -> str:
    """What the plan optimises (planning/planner.py OBJECTIVES): "prompt" (the first token of a long prompt)
    or "fastest" (decode speed alone) when the request asks for it, else "decode" (single-stream decode
    speed, a split that decodes alike and answers a long prompt much sooner preferred)."""
    asked = (data or {}).get("objective")
    return asked if asked in planner.OBJECTIVES else "decode"


def _compute_plan(model: ModelFile, form: PlanForm, objective: str = "decode") -> tuple[dict | None, str]:
    if not form.is_valid():
        return None, ""
    rows, error = plan_inputs(model, form)
    if error:
        return None, error
    try:
        plan = planner.plan(
            model.profile, planner_nodes(rows[1:], rows[0]), form.settings(), objective=objective
        )
    except planner.ClusterError as exc:
        return None, str(exc)
    plan["warnings"] += stale_calibration_warnings(rows)
    plan["warnings"] += tunnel_warnings(plan, rows[1:])
    return plan, ""


def _confirm_fields(form: PlanForm, objective: str = "decode") -> list[tuple[str, object]]:
    """The settings the page's plan was computed with, as the Confirm form posts them: what is confirmed is
    what was shown, whatever the settings form holds by then."""
    data = form.cleaned_data
    fields: list[tuple[str, object]] = [("full", 1)]
    if data.get("coordinator"):
        fields.append(("coordinator", data["coordinator"].pk))
    fields += [("nodes", node.pk) for node in data.get("nodes") or []]
    fields += [(key, data[key]) for key in ("ctx", "parallel", "cache_type", "clamp")]
    if data.get("beyond"):
        fields.append(("beyond", "on"))
    if objective != "decode":
        fields.append(("objective", objective))
    return fields


def _objective_links(request, objective: str) -> dict[str, str]:
    """The page's own address with each objective: the plan for long prompts, for decode speed alone, or
    back to the default."""
    query = request.GET.copy()
    query.pop("objective", None)
    links = {"decode": f"{request.path}?{query.urlencode()}"}
    for other in ("prompt", "fastest"):
        query["objective"] = other
        links[other] = f"{request.path}?{query.urlencode()}"
    return links


def _stale_reasons(form: PlanForm) -> list[str]:
    """Why the values on the form cannot be planned: each invalid field's label and error."""
    reasons = []
    for name, errors in form.errors.items():
        field = form.fields.get(name)
        label = (field.label or name.capitalize()) if field is not None else ""
        reasons += [f"{label}: {error}" if label else str(error) for error in errors]
    return reasons


def nothing_to_split(plan: dict | None) -> bool:
    """The plan and llama.cpp's default put the model on the same devices of one machine, block for block:
    a side-by-side comparison would show the same thing twice."""
    if not plan or not plan.get("fits"):
        return False

    def used(placements: list[dict]) -> dict:
        return {
            (p.get("node"), p.get("device")): (p.get("layers"), bool(p.get("output_layer")))
            for p in placements
            if p.get("layers") or p.get("output_layer")
        }

    mine = used(plan.get("placements") or [])
    theirs = used((plan.get("baseline") or {}).get("placements") or [])
    return len({node for node, _ in mine | theirs}) == 1 and mine == theirs


def _preview_context(request, model: ModelFile, form: PlanForm, manual_data=None) -> dict:
    objective = _objective(request.POST if request.method == "POST" else request.GET)
    plan, error = _compute_plan(model, form, objective)
    fits = bool(plan and plan["fits"])
    # A plan on a device its node's build lacks is shown, with why it cannot be confirmed.
    refused = plan_device_refusal(plan) if fits else ""
    confirmable = fits and not form.errors and not refused
    # The split by hand is an operator's; its form starts from the planner's split, or holds what was posted.
    by_hand = {"manual_form": None, "manual_plan": None, "manual_rows": []}
    if plan is not None and not form.errors and may_use(request.user, "deployments:manual"):
        rows, _ = plan_inputs(model, form)
        by_hand = manual_context(model, form.settings(), plan, rows, manual_data)
        if by_hand["manual_plan"]:
            by_hand["manual_deploy_refusal"] = _deploy_refusal(request.user, by_hand["manual_plan"])
    return {
        **by_hand,
        "model": model,
        "form": form,
        "plan": plan,
        "error": error or refused,
        "bars": bars.plan_bars(plan) if fits else None,
        "one_machine": nothing_to_split(plan),
        "uncalibrated": uncalibrated_nodes(plan),
        "commands": command_lines(model, plan) if fits else None,
        "stale_reasons": _stale_reasons(form),
        # Also when the planner's plan is refused: a split by hand may leave out the device it is refused for.
        "confirm_fields": _confirm_fields(form, objective) if fits and not form.errors else [],
        # The settings the plan on the page was computed with, which the split by hand is checked with.
        "plan_fields": _confirm_fields(form) if plan is not None and not form.errors else [],
        "objective": objective,
        "objective_links": _objective_links(request, objective),
        "decode_tie": DECODE_TIE,
        "confirmable": confirmable,
        "deploy_refusal": _deploy_refusal(request.user, plan) if confirmable else "",
        "confirm_token": _confirm_token(request.GET) or uuid.uuid4().hex,
        "endpoint_form": _endpoint_form(request.GET, plan),
    }


@role_required(VIEWER)
def plan_preview(request, pk: int):
    model = _get_model(pk)
    form = _plan_form(request, model, request.GET)
    context = _preview_context(request, model, form)
    template = "deployments/plan_preview.html"
    if not request.htmx:
        return render(request, template, context)
    context["oob"] = True
    if form.errors:
        context["stale_oob"] = True
        # The plan on the page stays, marked stale with the reason; the fields show their errors.
        return reswap(render(request, f"{template}#stale-update", context), "none")
    return render(request, f"{template}#plan", context)


@require_POST
@role_required(OPERATOR)
def plan_manual(request, pk: int):
    """Check a split by hand and show its predicted speed and memory beside the planner's and the default's
    (the page's manual region for htmx; the whole page otherwise). Nothing is stored."""
    model = _get_model(pk)
    form = _plan_form(request, model, request.POST)
    context = _preview_context(request, model, form, manual_data=request.POST)
    manual = context["manual_form"]
    valid = manual is not None and manual.is_valid()
    if request.htmx:
        # htmx swaps only a 200: the region comes back with its field errors either way.
        return render(request, "deployments/plan_preview.html#manual", context)
    return render(request, "deployments/plan_preview.html", context, status=200 if valid else 400)


@require_POST
@role_required(OPERATOR)
def plan_confirm(request, pk: int):
    model = _get_model(pk)
    form = _plan_form(request, model, request.POST)
    # The plan is computed again here: what is stored is what the planner says now, not what the page showed.
    plan, error = _compute_plan(model, form, _objective(request.POST))
    if plan is None or not plan["fits"]:
        context = _preview_context(request, model, form)
        context["error"] = error or ("" if form.errors else "This plan does not fit.")
        return render(request, "deployments/plan_preview.html", context, status=409)
    # "Deploy this split": the split by hand, checked again, takes the planner's place; the rest is the same.
    by_hand = request.POST.get("then") == DEPLOY_BY_HAND
    if by_hand:
        rows, _ = plan_inputs(model, form)
        manual = manual_form_for(model, form.settings(), plan, rows, request.POST)
        if manual is None or not manual.is_valid():
            context = _preview_context(request, model, form, manual_data=request.POST)
            context["error"] = "Nothing was deployed: the split by hand has errors (marked below)."
            return render(request, "deployments/plan_preview.html", context, status=400)
        plan = manual_plan(model, manual, rows)
    if refused := plan_device_refusal(plan):
        context = _preview_context(request, model, form)
        context["error"] = refused
        return render(request, "deployments/plan_preview.html", context, status=409)
    coordinator = next(n for n in Node.objects.filter(name=plan["coordinator"]))
    endpoint = EndpointForm(request.POST, coordinator=coordinator)
    if not endpoint.is_valid():
        context = _preview_context(request, model, form)
        context["confirm_token"] = _confirm_token(request.POST) or context["confirm_token"]
        context["endpoint_form"] = endpoint
        context["error"] = "Choose the endpoint again: " + " ".join(
            str(e) for errors in endpoint.errors.values() for e in errors
        )
        return render(request, "deployments/plan_preview.html", context, status=400)
    token = _confirm_token(request.POST)
    if token and (earlier := Deployment.objects.filter(confirm_token=token).first()):
        messages.info(request, f"This plan was already confirmed as {earlier.name}.")
        return redirect(earlier.get_absolute_url())
    port = endpoint.cleaned_data["port"]
    taken, unchecked = port_taken(coordinator, port, console_port=_console_port(request))
    if taken:
        endpoint.add_error("port", taken)
        context = _preview_context(request, model, form)
        context["confirm_token"] = token or context["confirm_token"]
        context["endpoint_form"] = endpoint
        context["error"] = f"Nothing was confirmed: {taken}"
        return render(request, "deployments/plan_preview.html", context, status=409)
    if unchecked:
        messages.warning(request, unchecked)
    deploy_now = request.POST.get("then") in ("deploy", DEPLOY_BY_HAND)
    try:
        deployment = _confirm(request, model, form, plan, endpoint, token, deploy=deploy_now)
    except DeployRefused as exc:
        # Nothing was confirmed; the refusal is on record against the model, since no deployment exists.
        history.record(request, "deployment.refused", model, changes={"reason": str(exc), "confirmed": False})
        context = _preview_context(request, model, form)
        context["confirm_token"] = token or context["confirm_token"]
        context["endpoint_form"] = endpoint
        context["error"] = f"Not deployed, and nothing was confirmed: {exc}"
        return render(request, "deployments/plan_preview.html", context, status=409)
    except IntegrityError:
        # The same form, posted twice at the same instant: the other request made the deployment.
        earlier = Deployment.objects.filter(confirm_token=token).first()
        if token is None or earlier is None:
            raise
        messages.info(request, f"This plan was already confirmed as {earlier.name}.")
        return redirect(earlier.get_absolute_url())
    if deploy_now:
        messages.success(
            request, f"Confirmed {deployment.name} and deploying: the steps run one after another."
        )
        return redirect("deployments:run", pk=deployment.pk)
    messages.success(request, f"Confirmed {deployment.name}. Deploy it when you are ready.")
    return redirect(deployment.get_absolute_url())


def uncalibrated_nodes(plan: dict | None) -> list[str]:
    """The plan's nodes that were never calibrated, by name: their speed figures are the table's guesses."""
    if not plan or not plan.get("coordinator"):
        return []
    return sorted(n.name for n in _plan_nodes(plan) if n.calibrated_at is None)


def _plan_nodes(plan: dict) -> list[Node]:
    names = {plan["coordinator"], *(p.get("node") for p in plan.get("placements", []))}
    return list(Node.objects.filter(name__in=names - {None}))


def _deploy_refusal(user, plan: dict) -> str:
    """Why this user may confirm the plan but not deploy it at once ("" when they may): deploying on the
    console's own host is an admin's (lifecycle.local_refusal says the same at Deploy)."""
    local = [n.name for n in _plan_nodes(plan) if not may_use_local_node(user, n)]
    if not local:
        return ""
    return f"{', '.join(local)} is the console's own host: after you confirm, an admin deploys it."


class DeployRefused(Exception):
    """Confirm and deploy: the deploy was refused, so the confirmation is rolled back with it."""


def _console_port(request) -> int | None:
    try:
        return int(request.META.get("SERVER_PORT") or 0) or None
    except ValueError:
        return None


def _confirm_token(data) -> str | None:
    token = data.get("confirm_token", "")
    return token if token and len(token) <= 64 and token.isalnum() else None


def _endpoint_form(data, plan: dict | None) -> EndpointForm | None:
    if not plan or not plan.get("fits"):
        return None
    coordinator = Node.objects.filter(name=plan["coordinator"]).first()
    return endpoint_form(data, coordinator) if coordinator else None


def default_deployment_name(model: ModelFile, plan: dict) -> str:
    """ "tiny @ 4096": the context llama.cpp will give it, which it caps at the model's trained one."""
    ctx = int(plan["settings"]["ctx"])
    trained = int((model.profile or {}).get("context_length") or 0)
    return f"{model.name} @ {min(ctx, trained) if trained else ctx}"


def _confirm(
    request, model: ModelFile, form: PlanForm, plan: dict, endpoint: EndpointForm, token, *, deploy=False
) -> Deployment:
    """The deployment and its audit entry, together or not at all. With `deploy` (Confirm and deploy), its
    deploy run too, in the same transaction and with the Deploy button's checks: a refused deploy raises
    DeployRefused and leaves nothing confirmed."""
    coordinator = endpoint.coordinator
    with transaction.atomic():
        deployment = Deployment.objects.create(
            name=form.cleaned_data["name"] or default_deployment_name(model, plan),
            model_file=model,
            coordinator=coordinator,
            plan=plan,
            plan_settings=plan["settings"],
            state=DeploymentState.CONFIRMED,
            host=endpoint.host(),
            port=endpoint.cleaned_data["port"],
            created_by=request.user,
            confirm_token=token,
            placed_by_hand=bool(plan.get("placed_by_hand")),
        )
        by_hand = {}
        if deployment.placed_by_hand:
            by_hand = {
                "placed_by_hand": True,
                "split": [
                    f"{c['node']}/{c['device']}: {c['layers']} blocks"
                    + (f", experts of {c['experts']}" if "experts" in c else "")
                    for c in plan.get("manual_counts", [])
                ],
                "planner_tokens_per_s": plan.get("planner_tokens_per_s"),
            }
        history.record(
            request,
            "deployment.confirm_by_hand" if deployment.placed_by_hand else "deployment.confirm",
            deployment,
            changes={
                **by_hand,
                "model": model.name,
                "coordinator": coordinator.name,
                "nodes": sorted({p["node"] for p in plan["placements"]}),
                "settings": plan["settings"],
                "endpoint": f"{deployment.host}:{deployment.port}",
                "predicted_tokens_per_s": plan["predicted_tokens_per_s"],
                "baseline_tokens_per_s": plan["baseline"]["predicted_tokens_per_s"],
                "objective": plan.get("objective", "decode"),
            },
        )
        if deploy:
            started, message = lifecycle.start_deploy(deployment, request.user)
            if not started:
                raise DeployRefused(message)
    return deployment
