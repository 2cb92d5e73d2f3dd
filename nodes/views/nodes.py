"""Node inventory, hardware (probe, host-key approval) and credential pages."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.db.models import ProtectedError, Q
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_POST

from audit import history
from jobs.models import ACTIVE_STATES as JOB_ACTIVE_STATES
from jobs.models import Job, refuse_local_node
from nodes.forms import CredentialForm, NodeFilterForm, NodeForm
from nodes.models import Credential, Node, Reachability, Transport
from nodes.probe.job import PROBE, start_probe
from ramdeck_site.roles import ADMIN, OPERATOR, VIEWER, role_required


def get_node(name: str) -> Node:
    return get_object_or_404(Node, name=name)


def hardware_context(node: Node) -> dict:
    """What templates/nodes/_hardware.html needs besides `node`."""
    return {
        "node": node,
        "devices": node.devices.all(),
        # The llama.cpp line comes from the build deployments use, not only from what the probe found on
        # the PATH (a build in another folder is not on it).
        "build": node.current_build,
        "active_probe": Job.objects.active().filter(node=node, kind=PROBE).first(),
        "active_calibration": Job.objects.active().filter(node=node, kind="calibrate").first(),
    }


def _filtered_nodes(params) -> tuple[NodeFilterForm, object]:
    form = NodeFilterForm(params)
    nodes = Node.objects.select_related("credential").prefetch_related("devices")
    if form.is_valid():
        q = form.cleaned_data["q"].strip()
        if q:
            nodes = nodes.filter(Q(name__icontains=q) | Q(address__icontains=q) | Q(notes__icontains=q))
        if form.cleaned_data["transport"]:
            nodes = nodes.filter(transport=form.cleaned_data["transport"])
        status = form.cleaned_data["status"]
        if status == "enabled":
            nodes = nodes.filter(enabled=True)
        elif status == "disabled":
            nodes = nodes.filter(enabled=False)
        elif status == "reachable":
            nodes = nodes.filter(reachability=Reachability.REACHABLE)
        elif status == "unreachable":
            nodes = nodes.exclude(reachability__in=[Reachability.REACHABLE, Reachability.UNKNOWN])
    return form, nodes


@role_required(VIEWER)
def node_list(request):
    form, nodes = _filtered_nodes(request.GET)
    template = "nodes/node_list.html"
    if request.htmx and request.htmx.target == "node-table":
        template += "#table"
    return render(request, template, {"filter_form": form, "nodes": nodes})


@role_required(VIEWER)
def node_detail(request, name: str):
    node = get_node(name)
    context = {
        **hardware_context(node),
        "jobs": Job.objects.filter(node=node).select_related("node")[:10],
        "deployments": node.coordinated_deployments.all()[:10],
        "model_files": node.model_files.all(),
    }
    return render(request, "nodes/node_detail.html", context)


@role_required(ADMIN)
def node_create(request):
    """Add a node. "Create a credential" on the form keeps what was typed (in the session, never in an
    address) and comes back here with the new credential chosen. An SSH node is probed as soon as it is
    added: the probe job is queued when the node's row commits, and the node page shows it."""
    if request.method == "POST" and request.POST.get("then") == "credential":
        request.session[NODE_DRAFT] = {k: request.POST.get(k, "") for k in DRAFT_FIELDS if k in request.POST}
        return redirect(
            f"{reverse('nodes:credential_create')}?{urlencode({'next': reverse('nodes:create')})}"
        )
    if request.method == "POST":
        form = NodeForm(request.POST)
    else:
        initial = request.session.pop(NODE_DRAFT, None) or {}
        if (chosen := request.GET.get("credential", "")).isdigit():
            initial["credential"] = int(chosen)
        form = NodeForm(initial=initial)
    if request.method == "POST" and form.is_valid():
        probe = None
        with transaction.atomic():
            node = form.save()
            history.record(request, "node.create", node, changes=history.form_changes(form))
            if node.transport == Transport.SSH and node.enabled:
                probe = start_probe(node, user=request.user)
                if probe is not None:
                    history.record(request, "node.probe", node, changes={"job": probe.pk})
        if probe is not None:
            messages.success(request, f"Node {node.name} added; probing its hardware now.")
        else:
            messages.success(request, f"Node {node.name} added.")
        return redirect(node)
    return render(request, "nodes/node_form.html", {"form": form, "node": None})


# The Add-a-node form's values kept while its user creates a credential (no secret among them).
NODE_DRAFT = "node_form_draft"
DRAFT_FIELDS = (
    "name", "transport", "platform_hint", "address", "ssh_user", "ssh_port", "rpc_port", "rpc_bind_address",
    "rpc_bind_everywhere", "rpc_tunnel", "authorized_keys_path", "may_coordinate", "enabled", "notes",
)  # fmt: skip


def _back_to_node_form(request) -> str:
    """Where the credential form returns when it was opened from the Add-a-node form, or ""."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    return target if target == reverse("nodes:create") else ""


@role_required(ADMIN)
def node_edit(request, name: str):
    node = get_node(name)
    form = NodeForm(request.POST or None, instance=node)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            node = form.save()
            history.record(request, "node.update", node, changes=history.form_changes(form))
        messages.success(request, f"Node {node.name} saved.")
        return redirect(node)
    return render(request, "nodes/node_form.html", {"form": form, "node": node})


@role_required(ADMIN)
def node_delete(request, name: str):
    """GET shows a confirmation page (no-JS path); POST deletes. htmx posts come from the inline button."""
    node = get_node(name)
    if request.method != "POST":
        return render(request, "nodes/node_confirm_delete.html", {"node": node})
    try:
        with transaction.atomic():
            snapshot = {"address": node.address, "transport": node.transport}
            history.record(request, "node.delete", node, changes=snapshot)
            # Its probes described hardware that is no longer in the pool: they go with it (the audit
            # history keeps the deletion). One still running ends with no node and is not shown.
            Job.objects.filter(node=node, kind=PROBE).exclude(state__in=JOB_ACTIVE_STATES).delete()
            node.delete()
    except ProtectedError:
        message = f"{node.name} is used by a model or a deployment; remove those first."
        if request.htmx:
            return HttpResponse(message, status=409)
        messages.error(request, message)
        return redirect(node)
    if request.htmx:
        # The row disappears in place; an empty 200 with the row as target removes it.
        return HttpResponse("")
    messages.success(request, f"Node {name} deleted.")
    return redirect("nodes:list")


@role_required(VIEWER)
def credential_list(request):
    credentials = Credential.objects.prefetch_related("nodes")
    return render(request, "nodes/credential_list.html", {"credentials": credentials})


@role_required(ADMIN)
def credential_create(request):
    return _credential_form(request, Credential())


@role_required(ADMIN)
def credential_edit(request, pk: int):
    return _credential_form(request, get_object_or_404(Credential, pk=pk))


def _credential_form(request, credential: Credential):
    creating = credential.pk is None
    back = _back_to_node_form(request)
    form = CredentialForm(request.POST or None, request.FILES or None, instance=credential)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            credential = form.save()
            changes = history.form_changes(form)
            changes.pop("generate", None)
            if form.cleaned_data.get("generate"):
                changes["key_pair"] = f"generated (ed25519, {credential.public_fingerprint})"
            elif form.cleaned_data.get("new_secret") is not None:
                changes["secret"] = ["(replaced)", "(replaced)"]
            history.record(
                request, "credential.create" if creating else "credential.update", credential, changes=changes
            )
        back_with_it = f"{back}?{urlencode({'credential': credential.pk})}" if back else ""
        if form.cleaned_data.get("generate"):
            messages.success(
                request, f"Key pair generated for {credential.name}. Put its public key on each node (below)."
            )
            edit = reverse("nodes:credential_edit", args=[credential.pk])
            return redirect(f"{edit}?{urlencode({'next': back})}" if back else edit)
        messages.success(request, f"Credential {credential.name} saved.")
        return redirect(back_with_it or "nodes:credentials")
    context = {
        "form": form,
        "credential": credential,
        "back": back,
        "back_with_it": f"{back}?{urlencode({'credential': credential.pk})}"
        if back and credential.pk
        else "",
    }
    return render(request, "nodes/credential_form.html", context)


@role_required(ADMIN)
@require_POST
def credential_delete(request, pk: int):
    credential = get_object_or_404(Credential, pk=pk)
    try:
        with transaction.atomic():
            history.record(request, "credential.delete", credential)
            credential.delete()
    except ProtectedError:
        messages.error(
            request, f"{credential.name} is used by a node; give those nodes another credential first."
        )
        return redirect("nodes:credentials")
    messages.success(request, f"Credential {credential.name} deleted.")
    return redirect("nodes:credentials")


@role_required(VIEWER)
@require_GET
def hardware(request, name: str):
    """The hardware panel alone (htmx polls it while a probe runs); a full load gets the node page."""
    node = get_node(name)
    if not request.htmx:
        return redirect(node)
    return render(request, "nodes/_hardware.html", hardware_context(node))


@role_required(OPERATOR)
@require_POST
def probe_now(request, name: str):
    node = get_node(name)
    if not node.enabled:
        messages.error(request, f"{node.name} is disabled; enable it before probing.")
        return redirect(node)
    if node.pending_host_key:
        messages.error(
            request, f"{node.name}'s host key awaits an admin's approval; nothing runs there until then."
        )
        return redirect(node)
    return start_node_job(request, node, start_probe, action="node.probe", what="probe", doing="Probing")


def start_node_job(request, node: Node, start, *, action: str, what: str, doing: str):
    """Start one job of a kind on the node unless one is queued or running (`start` returns None then), with
    its audit entry in the same transaction; land on the job, or back on the node with the reason."""
    refuse_local_node(request.user, node, what.capitalize() + "s", request=request)
    with transaction.atomic():
        job = start(node, user=request.user)
        if job is not None:
            history.record(request, action, node, changes={"job": job.pk})
    if job is None:
        messages.info(request, f"A {what} of {node.name} is already queued or running.")
        return redirect(node)
    messages.success(request, f"{doing} {node.name}.")
    return redirect(job)


@role_required(ADMIN)
@require_POST
def approve_host_key(request, name: str):
    node = get_node(name)
    seen = request.POST.get("fingerprint", "").strip()
    old = node.host_key_fingerprint
    if not node.pending_host_key:
        messages.info(request, f"{node.name} has no host key waiting for approval.")
        return redirect(node)
    with transaction.atomic():
        approved = node.approve_pending_host_key(seen, by=request.user)
        if approved:
            history.record(
                request,
                "node.host_key.approve",
                node,
                changes={"host_key_fingerprint": [old, node.host_key_fingerprint], "replaced": bool(old)},
            )
    if not approved:
        node.refresh_from_db()
        messages.error(
            request,
            f"The key waiting for approval is {node.pending_host_key_fingerprint or 'none'}, "
            f"not the one you saw ({seen or 'none'}). Check it again before approving.",
        )
        return redirect(node)
    messages.success(request, f"Host key {node.host_key_fingerprint} approved for {node.name}.")
    if node.enabled:
        # The first probe over the trusted connection also records a llama.cpp it finds on the node (a
        # release someone installed, the compose trial's demo nodes): the node is ready to plan on.
        start_probe(node, user=request.user, register_detected=True)
    return redirect(node)
