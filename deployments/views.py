"""Model registry, "what runs on this pool", plan preview and confirmation, deployment list and detail.

The run of a deployment (deploy, stop, its live steps) is deployments/lifecycle_views.py.
"""

from __future__ import annotations

import asyncio
import uuid

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages
from django.db import IntegrityError, transaction
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST
from django_htmx.http import reswap

from audit import history
from jobs.models import Job, refuse_local_node
from jobs.transport import TransportError, open_transport, shell_join
from nodes.models import Node
from ramdeck_site.roles import OPERATOR, VIEWER, role_required

from . import bars, fetch_policy, gguf_isolated, gguf_profile, planner
from .download_job import read_model_profile
from .endpoint import EndpointForm, endpoint_form
from .forms import ModelDownloadForm, ModelRegisterForm, PlanForm
from .lifecycle_steps import bind_host, endpoint_url
from .llamacpp import model_alias
from .models import Deployment, DeploymentState, ModelFile

POOL_CONTEXTS = (32768, 16384, 8192, 4096, 2048, 1024)
# A register request waits at most this long for a remote node (connect, header reads, sizes).
REMOTE_READ_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------------------
# Helpers


def _get_model(pk: int) -> ModelFile:
    return get_object_or_404(ModelFile.objects.select_related("node"), pk=pk)


def _planner_device(node: Node, d) -> planner.Device:
    source = d.bandwidth_source
    # ggml-rpc-server reports all of the machine's RAM for a CPU, whatever limit the probe found: llama.cpp's
    # own default split follows that.
    physical = (node.facts or {}).get("ram_physical_bytes") if d.kind == "cpu" else None
    return planner.Device(
        node=node.name,
        name=d.name,
        kind=d.kind,
        total_bytes=d.total_bytes,
        free_bytes=min(d.free_bytes, d.total_bytes),
        bandwidth_gbs=d.effective_bandwidth_gbs or planner.DEFAULT_BANDWIDTH_GBS.get(d.kind, 20.0),
        unified=d.unified_memory,
        wired_limit_bytes=d.wired_limit_bytes or 0,
        bandwidth_source="default" if source == "unknown" else source,
        # Blocks on a coordinator's own CPU run inside llama-server: its measured figure there, unless an
        # admin set the device's figure by hand.
        local_bandwidth_gbs=d.measured_local_bandwidth_gbs if source == "measured" else None,
        reported_free_bytes=physical if physical and physical != d.free_bytes else None,
    )


def planner_nodes(nodes: list[Node], coordinator: Node) -> list[planner.Node]:
    """The planner's view of Node and Device rows: the coordinator first; remote nodes by RPC address.

    Calibrated figures are used where they are (bandwidths per device; the node's pass and hop costs and
    its round trip to the RPC port), unless the probe has found other hardware since."""
    out = []
    for node in [coordinator, *[n for n in nodes if n.pk != coordinator.pk]]:
        rows = list(node.devices.all())
        calibrated = node.calibrated_at is not None and not any(
            d.measurement_state == "hardware_changed" for d in rows
        )
        rtt = node.link_rtt_ms if calibrated and node.link_rtt_ms is not None else node.rtt_ms
        out.append(
            planner.Node(
                name=node.name,
                address=node.rpc_endpoint_host,
                devices=tuple(_planner_device(node, d) for d in rows),
                coordinator=node.pk == coordinator.pk,
                rpc_port=node.rpc_port,
                rtt_ms=rtt,
                pass_overhead_ms=node.pass_overhead_ms if calibrated else None,
                hop_ms=node.rpc_hop_ms if calibrated else None,
                pipeline_overhead_ms=node.pipeline_overhead_ms if calibrated else None,
                **binding_cpu_quota(node.facts or {}),
            )
        )
    return out


def binding_cpu_quota(facts: dict) -> dict[str, float]:
    """The node's CPU quota and its period as the planner takes them, when the quota binds (below its
    cores: a larger one never holds the node back)."""
    quota, period = facts.get("cpu_quota_cores"), facts.get("cpu_quota_period_ms")
    if not quota or not period or quota >= (facts.get("cpu_cores") or float("inf")):
        return {}
    return {"cpu_quota_cores": float(quota), "cpu_quota_period_ms": float(period)}


def stale_calibration_warnings(nodes: list[Node]) -> list[str]:
    """Plan warnings for figures the planner uses although they are old."""
    old = sorted(f"{n.name}/{d.name}" for n in nodes for d in n.devices.all() if d.measurement_state == "old")
    if not old:
        return []
    return [
        f"The calibration of {', '.join(old)} is older than "
        f"{settings.RAMDECK_CALIBRATION_MAX_AGE_DAYS:g} days: calibrate again for a prediction you can trust."
    ]


def _pool_nodes() -> list[Node]:
    """Enabled nodes with fresh hardware data: the default pool."""
    nodes = Node.objects.filter(enabled=True).prefetch_related("devices")
    return [n for n in nodes if n.hardware_is_fresh and n.devices.exists()]


def _default_coordinator(model: ModelFile, pool: list[Node]) -> Node | None:
    if model.node.may_coordinate and model.node.enabled:
        return model.node
    return next((n for n in pool if n.may_coordinate), None)


async def _read_profile(node: Node, path: str) -> dict:
    """The GGUF profile of a file on a node, reading only its header (and its shards' headers).

    Async so that a slow or silent node holds up only this request, not the thread every synchronous view
    of the console shares under ASGI. The headers are parsed in a child process with a memory and a time
    limit (deployments/gguf_isolated.py): a hostile header stalls or exhausts that child, not daphne."""
    if node.is_local:
        profile = await gguf_isolated.profile_of_path(path)
        # A shard found beside the first may be a symlink out of the model folders.
        outside = [p for p in profile.get("shard_paths", [path]) if not fetch_policy.under_model_dirs(p)]
        if outside:
            raise gguf_profile.GGUFError(f"{outside[0]} lies outside the console's model folders.")
        return profile
    # open_transport reads the node's credential from the database.
    transport = await sync_to_async(open_transport)(node)
    try:
        async with asyncio.timeout(REMOTE_READ_TIMEOUT_S), transport:
            return await read_model_profile(transport, path)
    except TimeoutError:
        raise TransportError(
            f"{node.name} did not answer within {REMOTE_READ_TIMEOUT_S:g} s while its header was read."
        ) from None


def pool_fit(model: ModelFile, pool: list[Node]) -> dict:
    """Whether the model fits the pool, at the longest of a few contexts, and how fast."""
    coordinator = _default_coordinator(model, pool)
    if coordinator is None or not model.profile:
        return {"fits": False, "reason": "No node may coordinate." if coordinator is None else "No profile."}
    try:
        nodes = planner_nodes([n for n in pool if n.pk != coordinator.pk], coordinator)
        trained = model.profile.get("context_length") or POOL_CONTEXTS[0]
        for ctx in POOL_CONTEXTS:
            if ctx > trained:
                continue
            cfg = planner.Settings(ctx=ctx, clamp=settings.RAMDECK_UNIFIED_MEMORY_CLAMP)
            fits, tps = planner.quick_fit(model.profile, nodes, cfg)
            if fits:
                return {"fits": True, "ctx": ctx, "tps": tps, "coordinator": coordinator.name}
    except planner.ClusterError as exc:
        return {"fits": False, "reason": str(exc)}
    return {"fits": False, "reason": f"Not even with a context of {POOL_CONTEXTS[-1]}."}


def _commands(model: ModelFile, plan: dict, deployment: Deployment | None = None) -> dict:
    argv = ["llama-server", "-m", model.path, *plan["llama_server_args"]]
    if deployment is not None:
        # What the launch adds for a confirmed deployment (the key travels in a file, never on the line).
        host = bind_host(deployment)
        argv += ["--alias", model_alias(model.name), "--host", host, "--port", str(deployment.port)]
    server = shell_join(argv)
    rpc = [
        {"node": s["node"], "command": shell_join(["ggml-rpc-server", *s["args"]])}
        for s in plan["rpc_servers"]
    ]
    return {"llama_server": server, "rpc_servers": rpc}


# ---------------------------------------------------------------------------------------------------------
# Model registry and the pool overview


def _refuse_local(request, what: str, field: str = "node") -> None:
    """403 (audited) before anything is read or fetched when a non-admin names the console's own host."""
    value = request.POST.get(field, "")
    node = Node.objects.filter(pk=value).first() if value.isdigit() else None
    refuse_local_node(request.user, node, what, request=request)


def _models_page(request, *, form=None, download_form=None, status: int = 200):
    pool = _pool_nodes()
    rows = [{"model": m, "fit": pool_fit(m, pool)} for m in ModelFile.objects.select_related("node")]
    context = {
        "rows": rows,
        "form": form or ModelRegisterForm(user=request.user),
        "download_form": download_form or ModelDownloadForm(prefix="download", user=request.user),
        "pool": pool,
    }
    return render(request, "deployments/model_list.html", context, status=status)


@role_required(VIEWER)
def model_list(request):
    return _models_page(request)


@require_POST
@role_required(OPERATOR)
async def model_register(request):
    await sync_to_async(_refuse_local)(request, "Model registrations")
    form = await sync_to_async(ModelRegisterForm)(request.POST, user=request.user)
    if await sync_to_async(form.is_valid)():
        node, path = form.cleaned_data["node"], form.cleaned_data["path"]
        try:
            profile = await _read_profile(node, path)
        except gguf_profile.GGUFError as exc:
            form.add_error("path", str(exc))
        except Exception as exc:  # noqa: BLE001 - a transport failure is shown to the operator, not raised
            form.add_error("path", f"Could not read the file on {node.name}: {exc}")
        else:
            if name := await sync_to_async(form.name_from_file)(profile):
                model = await sync_to_async(_register)(request, name, node, path, profile)
                await sync_to_async(messages.success)(request, f"Registered {model.name}.")
                return redirect("deployments:models")
    return await sync_to_async(_models_page)(request, form=form, status=400)


def _register(request, name: str, node: Node, path: str, profile: dict) -> ModelFile:
    with transaction.atomic():
        model = ModelFile.objects.create(
            name=name,
            node=node,
            path=path,
            shard_paths=profile.pop("shard_paths", [path]),
            size_bytes=profile.get("size_bytes", 0),
            profile=profile,
            created_by=request.user,
        )
        history.record(
            request,
            "model.register",
            model,
            changes={"node": node.name, "path": path, "architecture": profile["architecture"]},
        )
    return model


@require_POST
@role_required(OPERATOR)
def model_download(request):
    """Start a download job; its page shows the live log, and the model appears once its header is read."""
    _refuse_local(request, "Downloads", field="download-node")
    form = ModelDownloadForm(request.POST, prefix="download", user=request.user)
    if not form.is_valid():
        return _models_page(request, download_form=form, status=400)
    node, params = form.cleaned_data["node"], form.params()
    with transaction.atomic():
        job = Job.objects.create(
            kind="download",
            node=node,
            title=f"Download {params['name']} onto {node.name}"[:200],
            params=params,
            created_by=request.user,
        )
        history.record(request, "model.download", job, changes={"node": node.name, **params})
        job.enqueue()
    return redirect(job.get_absolute_url())


# ---------------------------------------------------------------------------------------------------------
# Plan preview and confirmation


def _plan_form(request, model: ModelFile, data) -> PlanForm:
    """The plan form bound to the request's values, missing ones taken from the defaults.

    The page's own form sends a `full` marker: then an absent `nodes` means "no node ticked" rather than
    "not given", which defaults to the whole pool.
    """
    nodes_qs = Node.objects.filter(enabled=True).prefetch_related("devices")
    coordinators = nodes_qs.filter(may_coordinate=True)
    pool = _pool_nodes()
    coordinator = _default_coordinator(model, pool)
    bound = {
        "ctx": min(4096, model.profile.get("context_length") or 4096),
        "parallel": 1,
        "cache_type": "f16",
        "clamp": settings.RAMDECK_UNIFIED_MEMORY_CLAMP,
        "coordinator": coordinator.pk if coordinator else "",
        "nodes": [n.pk for n in pool],
        "name": "",
    }
    data = data or {}
    for key in bound:
        if key == "nodes":
            if "nodes" in data or "full" in data:
                bound["nodes"] = data.getlist("nodes") if hasattr(data, "getlist") else data.get("nodes", [])
        elif key in data:
            bound[key] = data.get(key)
    return PlanForm(bound, nodes_qs=nodes_qs, coordinators_qs=coordinators)


def _compute_plan(model: ModelFile, form: PlanForm) -> tuple[dict | None, str]:
    if not form.is_valid():
        return None, ""
    coordinator = form.cleaned_data["coordinator"] or _default_coordinator(model, _pool_nodes())
    if coordinator is None:
        return None, "No node may coordinate: mark one as 'may coordinate' on its node page."
    selected = [n for n in form.cleaned_data["nodes"] if n.pk != coordinator.pk]
    try:
        plan = planner.plan(model.profile, planner_nodes(selected, coordinator), form.settings())
    except planner.ClusterError as exc:
        return None, str(exc)
    plan["warnings"] += stale_calibration_warnings([coordinator, *selected])
    return plan, ""


def _confirm_fields(form: PlanForm) -> list[tuple[str, object]]:
    """The settings the page's plan was computed with, as the Confirm form posts them: what is confirmed is
    what was shown, whatever the settings form holds by then."""
    data = form.cleaned_data
    fields: list[tuple[str, object]] = [("full", 1)]
    if data.get("coordinator"):
        fields.append(("coordinator", data["coordinator"].pk))
    fields += [("nodes", node.pk) for node in data.get("nodes") or []]
    fields += [(key, data[key]) for key in ("ctx", "parallel", "cache_type", "clamp")]
    return fields


def _stale_reasons(form: PlanForm) -> list[str]:
    """Why the values on the form cannot be planned: each invalid field's label and error."""
    reasons = []
    for name, errors in form.errors.items():
        field = form.fields.get(name)
        label = (field.label or name.capitalize()) if field is not None else ""
        reasons += [f"{label}: {error}" if label else str(error) for error in errors]
    return reasons


def _preview_context(request, model: ModelFile, form: PlanForm) -> dict:
    plan, error = _compute_plan(model, form)
    fits = bool(plan and plan["fits"])
    return {
        "model": model,
        "form": form,
        "plan": plan,
        "error": error,
        "bars": bars.plan_bars(plan) if fits else None,
        "commands": _commands(model, plan) if fits else None,
        "stale_reasons": _stale_reasons(form),
        "confirm_fields": _confirm_fields(form) if fits and not form.errors else [],
        "confirmable": fits and not form.errors,
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
def plan_confirm(request, pk: int):
    model = _get_model(pk)
    form = _plan_form(request, model, request.POST)
    # The plan is computed again here: what is stored is what the planner says now, not what the page showed.
    plan, error = _compute_plan(model, form)
    if plan is None or not plan["fits"]:
        context = _preview_context(request, model, form)
        context["error"] = error or ("" if form.errors else "This plan does not fit.")
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
    try:
        deployment = _confirm(request, model, form, plan, endpoint, token)
    except IntegrityError:
        # The same form, posted twice at the same instant: the other request made the deployment.
        earlier = Deployment.objects.filter(confirm_token=token).first()
        if token is None or earlier is None:
            raise
        messages.info(request, f"This plan was already confirmed as {earlier.name}.")
        return redirect(earlier.get_absolute_url())
    messages.success(request, f"Confirmed {deployment.name}.")
    return redirect(deployment.get_absolute_url())


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
    request, model: ModelFile, form: PlanForm, plan: dict, endpoint: EndpointForm, token
) -> Deployment:
    """The deployment and its audit entry, together or not at all."""
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
        )
        history.record(
            request,
            "deployment.confirm",
            deployment,
            changes={
                "model": model.name,
                "coordinator": coordinator.name,
                "nodes": sorted({p["node"] for p in plan["placements"]}),
                "settings": plan["settings"],
                "endpoint": f"{deployment.host}:{deployment.port}",
                "predicted_tokens_per_s": plan["predicted_tokens_per_s"],
                "baseline_tokens_per_s": plan["baseline"]["predicted_tokens_per_s"],
            },
        )
    return deployment


# ---------------------------------------------------------------------------------------------------------
# Deployments


@role_required(VIEWER)
def deployment_list(request):
    deployments = Deployment.objects.select_related("model_file", "coordinator")[:200]
    return render(request, "deployments/deployment_list.html", {"deployments": deployments})


@role_required(VIEWER)
def deployment_detail(request, pk: int):
    deployment = get_object_or_404(Deployment.objects.select_related("model_file", "coordinator"), pk=pk)
    plan = deployment.plan or {}
    context = {
        "deployment": deployment,
        "plan": plan,
        "commands": _commands(deployment.model_file, plan, deployment) if plan.get("fits") else None,
        "run_url": reverse("deployments:run", args=[pk]),
        "speed_reasons": deployment.speed_miss_reasons(),
        "endpoint": endpoint_url(deployment),
    }
    return render(request, "deployments/deployment_detail.html", context)
