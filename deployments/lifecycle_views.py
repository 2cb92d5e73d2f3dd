"""Pages and buttons of a deployment's run (deploy, stop, restart, redeploy) and of a node's llama.cpp builds.

The plan preview and the deployment list are deployments/views.py; this module is the part after confirm.
Every button is a POST for operators and is audited by the lifecycle function it calls.
"""

from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from django import forms
from django.conf import settings
from django.contrib import messages
from django.db import transaction
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST

from audit import history
from jobs.models import Job, JobLogLine, refuse_local_node
from nodes.models import Node
from ramdeck_site.roles import OPERATOR, VIEWER, can_operate, role_required

from . import build_checks, lifecycle
from .build_job import allowed_tarball, offered_tarballs, pinned_tarball_path, tarball_dir
from .endpoint import LOOPBACK_HOSTS
from .lifecycle_steps import endpoint_url, reach_host
from .llamacpp import model_alias
from .llamacpp_source import PINNED
from .models import ACTIVE_STATES, Deployment, DeploymentState, RpcMode, StaleProcess


def _get_deployment(pk: int) -> Deployment:
    return get_object_or_404(
        Deployment.objects.select_related("coordinator", "model_file", "created_by"), pk=pk
    )


def refuse_on_console_host(request, deployment: Deployment, what: str) -> None:
    """403 (LocalNodeRefused, audited) when the deployment uses the console's own host and the user is no
    admin. Not only starting and stopping: its API key opens a llama-server running as the console's user,
    direct RPC mode opens an unauthenticated rpc-server on the console's host to the LAN, and self-healing
    starts processes there on its own; each is the admins' to decide."""
    for node in lifecycle.deployment_nodes(deployment):
        refuse_local_node(request.user, node, what, request=request)


def _steps(deployment: Deployment) -> list[dict]:
    steps = list(deployment.steps.select_related("job").order_by("order", "pk"))
    tails = log_tails([step.job for step in steps], 6)
    return [{"step": step, "job": step.job, "tail": tails[step.job_id]} for step in steps]


def log_tails(jobs: list[Job], count: int) -> dict[int, list[str]]:
    """The last `count` log lines of each job, in one query however many jobs (the run page grows a step
    per worker and per heal): a job's last lines are those at or past its `next_seq - count`."""
    tails: dict[int, list[str]] = {job.pk: [] for job in jobs}
    if not jobs:
        return tails
    near_the_end = Q()
    for job in jobs:
        near_the_end |= Q(job_id=job.pk, seq__gte=job.next_seq - count)
    rows = JobLogLine.objects.filter(near_the_end).order_by("job_id", "seq").values_list("job_id", "text")
    for job_id, text in rows:
        tails[job_id].append(text)
    return {pk: lines[-count:] for pk, lines in tails.items()}


def run_context(user, deployment: Deployment) -> dict:
    """What the run page's live regions show (also rendered by the websocket consumer)."""
    plan = deployment.plan or {}
    predicted = plan.get("predicted_tokens_per_s")
    measured = deployment.measured_decode_tps
    steps = _steps(deployment)
    return {
        "deployment": deployment,
        "steps": steps,
        # rpc-servers an admin let listen on every interface: they have no authentication.
        "exposed": [
            f"{row['job'].node_name} ({row['job'].params.get('bind')}:{row['job'].params.get('port')})"
            for row in steps
            if row["step"].name == "rpc-server" and row["job"].params.get("exposed")
        ],
        "endpoint": endpoint_url(deployment),
        "model_alias": model_alias(deployment.model_file.name),
        "predicted_tps": predicted,
        "baseline_tps": (plan.get("baseline") or {}).get("predicted_tokens_per_s"),
        "measured_ratio": (measured / predicted) if measured and predicted else None,
        "speed_reasons": deployment.speed_miss_reasons(),
        "verification": deployment.verification or {},
        "is_active": deployment.state in ACTIVE_STATES,
        "is_moving": deployment.state
        in (
            DeploymentState.PREPARING,
            DeploymentState.LAUNCHING,
            DeploymentState.VERIFYING,
            DeploymentState.STOPPING,
        ),
        "can_operate": can_operate(user),
        # The API key, the RPC mode and self-healing of a deployment on the console's own host: admins only.
        "may_control": can_operate(user) and not lifecycle.local_refusal(deployment, user),
        "may_deploy": deployment.state == DeploymentState.CONFIRMED,
        "may_stop": deployment.state in ACTIVE_STATES and deployment.state != DeploymentState.STOPPING,
        "may_restart": deployment.state in (DeploymentState.RUNNING, DeploymentState.DEGRADED),
        "may_redeploy": deployment.state in (DeploymentState.STOPPED, DeploymentState.FAILED),
        "self_heal_limit": settings.RAMDECK_SELF_HEAL_ATTEMPTS,
        **rpc_mode_context(deployment),
        # The same plan's earlier and later runs: what this one was redeployed from, and its redeploys.
        "history": Deployment.objects.filter(
            Q(redeployed_from=deployment) | Q(pk=deployment.redeployed_from_id or 0)
        ).order_by("-created_at")[:10],
    }


def rpc_mode_context(deployment: Deployment) -> dict:
    """The run page's RPC line: the mode chosen, the one a deploy would use now, and why not, if it cannot."""
    try:
        workers = lifecycle.workers_of(deployment)
        effective = lifecycle.rpc_mode(deployment, workers)
        # Checked (names resolved) only where the form is: not on the polled page of an active deployment.
        active = deployment.state in ACTIVE_STATES
        problem = "" if active else lifecycle.rpc_refusal(deployment, workers)
    except (KeyError, ValueError, IndexError):
        effective, problem = "", ""
    return {"rpc_modes": RpcMode.choices, "rpc_effective": effective, "rpc_problem": problem}


@role_required(VIEWER)
def deployment_run(request, pk: int):
    deployment = _get_deployment(pk)
    template = "deployments/lifecycle/run.html"
    if request.htmx and request.htmx.target == "deployment-run":
        template += "#run"
    return render(request, template, run_context(request.user, deployment))


def _process_rows(deployment: Deployment) -> tuple[list[dict], dict, object]:
    """What the monitor saw last (rows, metrics, when), or the recorded processes not checked yet. No
    SSH or HTTP here: the page is polled, and the monitor's beat task does the looking."""
    status = deployment.live_status or {}
    checked_at = parse_datetime(status["checked_at"]) if status.get("checked_at") else None
    if status.get("processes") is not None and checked_at:
        return status["processes"], status.get("metrics") or {}, checked_at
    rows = [{**info, "alive": None} for info in (deployment.processes or {}).values()]
    return sorted(rows, key=lambda r: (r["role"] != "llama-server", r["node"])), {}, None


@role_required(VIEWER)
def deployment_processes(request, pk: int):
    """Per-node process status (alive, PID, uptime, memory) and /metrics numbers, as the monitor saw them."""
    deployment = _get_deployment(pk)
    rows, metrics, checked_at = _process_rows(deployment)
    live = deployment.state in (DeploymentState.RUNNING, DeploymentState.DEGRADED)
    return render(
        request,
        "deployments/lifecycle/processes.html",
        {
            "deployment": deployment,
            "rows": rows,
            "metrics": metrics if live else {},
            "checked_at": checked_at,
        },
    )


@role_required(OPERATOR)
def deployment_api_key(request, pk: int):
    """The API key, for operators only (admins only on the console's own host); every reveal is audited."""
    deployment = _get_deployment(pk)
    refuse_on_console_host(request, deployment, "API keys of deployments")
    key = deployment.api_key() if deployment.api_key_encrypted else ""
    history.record(request, "deployment.api_key_viewed", deployment)
    context = {
        "deployment": deployment,
        "api_key": key,
        "endpoint": endpoint_url(deployment),
        "model_alias": model_alias(deployment.model_file.name),
        "loopback": reach_host(deployment) in LOOPBACK_HOSTS,
    }
    template = "deployments/lifecycle/api_key.html" + ("#key" if request.htmx else "")
    return render(request, template, context)


@require_POST
@role_required(OPERATOR)
def deployment_deploy(request, pk: int):
    deployment = _get_deployment(pk)
    started, message = lifecycle.start_deploy(deployment, request.user)
    (messages.success if started else messages.error)(request, message)
    return redirect("deployments:run", pk=deployment.pk)


@role_required(OPERATOR)
def deployment_stop(request, pk: int):
    """Stop asks first: GET (the run page's Stop link) shows what stops; only a POST that says `confirm`
    stops it. It works without JavaScript; a POST without `confirm` shows the question again."""
    deployment = _get_deployment(pk)
    if request.method != "POST" or request.POST.get("confirm") != "yes":
        rows, _metrics, _checked = _process_rows(deployment)
        context = {
            "deployment": deployment,
            "rows": rows,
            "endpoint": endpoint_url(deployment),
            "may_stop": deployment.state in ACTIVE_STATES and deployment.state != DeploymentState.STOPPING,
        }
        status = 400 if request.method == "POST" else 200
        return render(request, "deployments/lifecycle/stop_confirm.html", context, status=status)
    stopped, message = lifecycle.stop_deployment(deployment, request.user)
    (messages.success if stopped else messages.error)(request, message)
    return redirect("deployments:run", pk=deployment.pk)


@require_POST
@role_required(OPERATOR)
def deployment_restart(request, pk: int):
    deployment = _get_deployment(pk)
    stopped, message = lifecycle.stop_deployment(deployment, request.user, then_redeploy=True)
    if stopped:
        messages.success(
            request, "Restarting: it stops, then the same plan deploys again as a new deployment."
        )
    else:
        messages.error(request, message)
    return redirect("deployments:run", pk=deployment.pk)


@require_POST
@role_required(OPERATOR)
def deployment_rpc_mode(request, pk: int):
    """Choose how the coordinator reaches the rpc-servers (deployments/rpc_guard.py) before a deploy or a
    redeploy; audited. A running deployment keeps its mode until it is stopped."""
    deployment = _get_deployment(pk)
    refuse_on_console_host(request, deployment, "RPC modes of deployments")
    wanted = request.POST.get("mode", "")
    if wanted not in RpcMode.values:
        messages.error(request, "Choose auto, tunnel or direct.")
    elif deployment.state in ACTIVE_STATES:
        messages.error(request, "Stop the deployment first: the mode applies when it is deployed again.")
    elif deployment.rpc_mode != wanted:
        before = deployment.rpc_mode
        deployment.record(rpc_mode=wanted)
        history.record(request, "deployment.rpc_mode", deployment, changes={"rpc_mode": [before, wanted]})
        messages.success(request, f"RPC: {RpcMode(wanted).label}.")
    return redirect("deployments:run", pk=deployment.pk)


@require_POST
@role_required(OPERATOR)
def deployment_self_heal(request, pk: int):
    """Turn self-healing on or off (deployments/healing.py); audited."""
    deployment = _get_deployment(pk)
    refuse_on_console_host(request, deployment, "Self-healing switches of deployments")
    wanted = request.POST.get("on") == "1"
    if deployment.self_heal != wanted:
        deployment.record(self_heal=wanted)
        history.record(request, "deployment.self_heal", deployment, changes={"on": wanted})
    state = "on: a degraded deployment restarts what is missing" if wanted else "off"
    messages.success(request, f"Self-healing is {state}.")
    return redirect("deployments:run", pk=deployment.pk)


@require_POST
@role_required(OPERATOR)
def deployment_redeploy(request, pk: int):
    deployment = _get_deployment(pk)
    if deployment.state not in (DeploymentState.STOPPED, DeploymentState.FAILED):
        messages.error(request, "Only a stopped or failed deployment can be redeployed.")
        return redirect("deployments:run", pk=deployment.pk)
    fresh, started, message = lifecycle.redeploy(deployment, request.user)
    (messages.success if started else messages.error)(request, message)
    return redirect("deployments:run", pk=fresh.pk)


# --------------------------------------------------------------------------------------------------
# Builds of a node
# --------------------------------------------------------------------------------------------------


_GIT_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
_GIT_SCHEMES = ("https", "http", "ssh", "git", "file")
# git's SSH shorthand, [user@]host:path (such as git@github.com:ggml-org/llama.cpp.git).
_SCP_LIKE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9][A-Za-z0-9.-]*:[^\s:][^\s]*")


def _git_url_problem(url: str) -> str | None:
    """Why git must not be given this URL, or None. `TRANSPORT::ADDRESS` is git's remote-helper syntax
    (`ext::` runs a command); an option-like or spaced value is no URL."""
    if url.startswith("-") or any(c.isspace() or not c.isprintable() for c in url):
        return "This is not a git URL: one has no spaces or control characters and does not start with '-'."
    if "::" in url:
        return "Remote-helper URLs (TRANSPORT::ADDRESS, such as ext::) are not accepted; give an https URL."
    if "://" in url:
        parts = urlsplit(url)
        if parts.scheme.lower() not in _GIT_SCHEMES:
            return f"git URLs here start with {', '.join(s + '://' for s in _GIT_SCHEMES)}."
        if parts.scheme.lower() != "file" and not parts.hostname:
            return "This URL names no host: give one such as https://github.com/ggml-org/llama.cpp.git."
        if not parts.path.strip("/"):
            return "This URL names no repository: give one such as https://github.com/ggml-org/llama.cpp.git."
        return None
    if url.startswith("/") or _SCP_LIKE.fullmatch(url):
        return None  # a repository folder on the node, or user@host:path
    return (
        "This is not a git URL: give an https:// URL (such as https://github.com/ggml-org/llama.cpp.git), "
        "user@host:path for SSH, or the absolute path of a repository on the node."
    )


class BuildForm(forms.Form):
    source = forms.ChoiceField(
        choices=[
            ("tarball", "Source tarball on this console (uploaded to the node over SFTP)"),
            ("git", "Git URL and ref (the node fetches it)"),
            ("existing", "Existing install on the node (a folder holding llama-server)"),
        ],
        widget=forms.RadioSelect,
    )
    tarball = forms.ChoiceField(
        required=False,
        choices=[],
        help_text="A source tarball in the console's tarball folder (RAMDECK_TARBALL_DIR). The pinned "
        "llama.cpp source is fetched from PyPI once, its SHA-256 checked, when a build first needs it.",
    )
    git_url = forms.CharField(
        label="Git URL",
        required=False,
        max_length=500,
        help_text="https://, user@host:path or a path on the node.",
    )
    git_ref = forms.CharField(
        label="Git ref", required=False, max_length=200, help_text="A branch, tag or commit, such as b6800."
    )
    path = forms.CharField(
        label="Folder", required=False, max_length=1000,
        help_text="Absolute path of the folder on the node that holds llama-server and ggml-rpc-server.",
    )  # fmt: skip
    backend = forms.ChoiceField(
        choices=[
            ("auto", "Detect"),
            ("cpu", "CPU"),
            ("cuda", "CUDA"),
            ("metal", "Metal"),
            ("vulkan", "Vulkan"),
        ]
    )
    rebuild = forms.BooleanField(required=False, help_text="Recompile even when the build folder is current.")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Only files of RAMDECK_TARBALL_DIR are offered (and accepted): no other file leaves the console.
        self.fields["tarball"].choices = [("", "—")] + [(n, _tarball_label(n)) for n in offered_tarballs()]

    def clean(self):
        data = super().clean()
        source = data.get("source")
        if source == "tarball":
            name = data.get("tarball") or default_tarball()
            if name == PINNED.filename:
                # Fetched by the build job on first use, so it need not be on this console yet.
                path = pinned_tarball_path()
            else:
                path = allowed_tarball(os.path.join(tarball_dir(), name)) if name else None
            if path is None:
                self.add_error("tarball", f"Choose a tarball in {settings.RAMDECK_TARBALL_DIR}.")
            data["tarball"] = path or ""
        if source == "existing":
            path = data.get("path", "").strip()
            if not path:
                self.add_error("path", "Give the folder that holds llama-server and ggml-rpc-server.")
            elif not path.startswith("/"):
                self.add_error("path", "Give an absolute path (starting with /).")
            else:
                data["path"] = posixpath.normpath(path)
        if source == "git":
            data["git_url"] = data.get("git_url") or settings.RAMDECK_LLAMACPP_GIT_URL
            data["git_ref"] = data.get("git_ref") or settings.RAMDECK_LLAMACPP_GIT_REF
            if problem := _git_url_problem(data["git_url"]):
                self.add_error("git_url", problem)
            if not _GIT_REF.fullmatch(data["git_ref"]) or ".." in data["git_ref"]:
                self.add_error(
                    "git_ref",
                    "A git ref (branch, tag or commit) has letters, digits, '.', '_', '-' and '/' only, "
                    "starts with a letter or digit and has no '..'.",
                )
        return data

    def params(self) -> dict:
        data = self.cleaned_data
        keep = {"tarball": ["tarball"], "git": ["git_url", "git_ref"], "existing": ["path"]}[data["source"]]
        return {
            "source": data["source"],
            "backend": data["backend"],
            "rebuild": data["rebuild"],
            **{k: data[k] for k in keep},
        }


def _tarball_label(name: str) -> str:
    if name != PINNED.filename:
        return name
    state = "on this console" if os.path.isfile(pinned_tarball_path()) else "fetched from PyPI on first use"
    return f"{name} (pinned llama.cpp source, {state})"


def default_tarball() -> str:
    """The tarball the form offers first: RAMDECK_LLAMACPP_TARBALL (a name or a path) when that file is in
    the tarball folder, else the pinned llama.cpp source."""
    chosen = settings.RAMDECK_LLAMACPP_TARBALL
    path = allowed_tarball(os.path.join(tarball_dir(), chosen)) if chosen else None
    return os.path.basename(path) if path else PINNED.filename


def _build_page(request, node: Node, form: BuildForm, status: int = 200):
    return render(
        request,
        "deployments/lifecycle/builds.html",
        {
            "node": node,
            "builds": node.builds.all()[:20],
            "jobs": Job.objects.filter(node=node, kind="build")[:10],
            "form": form,
            "can_operate": can_operate(request.user),
        },
        status=status,
    )


@role_required(VIEWER)
def node_builds(request, name: str):
    node = get_object_or_404(Node, name=name)
    initial = {
        "source": "tarball",
        "tarball": default_tarball(),
        "git_url": settings.RAMDECK_LLAMACPP_GIT_URL,
        "git_ref": settings.RAMDECK_LLAMACPP_GIT_REF,
        "backend": "auto",
    }
    return _build_page(request, node, BuildForm(initial=initial))


@require_POST
@role_required(OPERATOR)
async def node_build_start(request, name: str):
    """Async so that the checks on the node (build_checks) hold up only this request."""
    node = await sync_to_async(get_object_or_404)(Node, name=name)
    await sync_to_async(refuse_local_node)(request.user, node, "Builds", request=request)
    form = BuildForm(request.POST)
    if await sync_to_async(form.is_valid)():
        for field, message in (await build_checks.source_problems(node, form.params())).items():
            form.add_error(field, message)
    if form.errors:
        return await sync_to_async(_build_page)(request, node, form, status=400)
    return await sync_to_async(_start_build)(request, node, form.params())


def _start_build(request, node: Node, params: dict):
    # The job, its audit entry and the enqueue (on commit) happen together or not at all.
    with transaction.atomic():
        job = Job.objects.create(
            kind="build",
            node=node,
            title=f"Build llama.cpp on {node.name} ({params['source']})",
            params=params,
            created_by=request.user,
        )
        history.record(request, "build.requested", node, changes=params)
        job.enqueue()
    return redirect(job.get_absolute_url())


# --------------------------------------------------------------------------------------------------
# Stale processes (found by the periodic scan) with a one-click reap
# --------------------------------------------------------------------------------------------------


@role_required(VIEWER)
def stale_processes(request):
    """A region for the dashboard (and a page of its own): our processes that no deployment owns."""
    rows = StaleProcess.objects.select_related("node")
    return render(
        request,
        "deployments/lifecycle/stale.html" + ("#region" if request.htmx else ""),
        {"rows": rows, "can_operate": can_operate(request.user)},
    )


@require_POST
@role_required(OPERATOR)
def stale_reap(request, pk: int):
    stale = get_object_or_404(StaleProcess.objects.select_related("node"), pk=pk)
    refuse_local_node(request.user, stale.node, "Reaps", request=request)
    with transaction.atomic():
        job = Job.objects.create(
            kind="reap",
            node=stale.node,
            title=f"Reap {stale.program} PID {stale.pid} on {stale.node.name}:{stale.port}",
            # The PID too: the reap ends that process only, never whatever holds the port by now.
            params={"ports": [stale.port], "pid": stale.pid},
            created_by=request.user,
        )
        history.record(
            request, "process.reap_requested", stale.node, changes={"pid": stale.pid, "port": stale.port}
        )
        job.enqueue()
    return redirect(job.get_absolute_url())
