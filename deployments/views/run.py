"""Pages and buttons of a deployment's run (deploy, stop, restart, redeploy) and of a node's llama.cpp builds.

The plan preview and the deployment list are deployments/views/plan.py; this module is the part after confirm.
Every button is a POST for operators and is audited by the lifecycle function it calls."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST

from audit import history
from deployments.charts import sparkline
from deployments.endpoint import endpoint_url, is_loopback, snippets
from deployments.lifecycle import actions as lifecycle
from deployments.models import ACTIVE_STATES, REDEPLOYABLE_STATES, Deployment, DeploymentState, RpcMode
from deployments.monitor import metrics_sentences
from deployments.views.plan import nothing_to_split
from jobs.models import Job, JobLogLine, refuse_local_node
from llamacpp.args import model_alias
from nodes.models import Node
from ramdeck_site.roles import CHAT, OPERATOR, VIEWER, can_operate, may_use, role_required


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


def _steps(deployment: Deployment, latest_run: Job | None) -> list[dict]:
    """The steps of the latest deploy run and what came after it (heals, the stop): a redeployed
    deployment's earlier runs are listed apart, by their jobs."""
    steps = deployment.steps.select_related("job", "job__node").order_by("order", "pk")
    if latest_run is not None:
        steps = steps.filter(job__created_at__gte=latest_run.created_at)
    steps = list(steps)
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
    deploy_runs = list(lifecycle.runs_of(deployment, lifecycle.DEPLOY)[:11])
    steps = _steps(deployment, deploy_runs[0] if deploy_runs else None)
    # Why this user may not start or stop it (its nodes include the console's own host), or "".
    local_refusal = lifecycle.local_refusal(deployment, user)
    on_console_host = bool(local_refusal)
    return {
        # Templates ask `user|may:"route"` before offering an action; the websocket re-render has no request.
        "user": user,
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
        "one_machine": nothing_to_split(plan),
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
        # From the roles the views declare (ramdeck_site/roles.py `may_use`), as the templates' `may` filter.
        "may_control": may_use(user, "deployments:rpc_mode") and not on_console_host,
        # The API key is shown to the chat role too (a family member's chat program needs it), with the same
        # exception: the console's own host's is the admins'.
        "may_see_key": may_use(user, "deployments:api_key") and not on_console_host,
        # Deploy, Stop, Restart and Redeploy start or end processes: on the console's own host they are the
        # admins' (lifecycle.local_refusal), so an operator is told so instead of shown buttons that refuse.
        "local_refusal": local_refusal,
        "may_deploy": deployment.state == DeploymentState.CONFIRMED and not on_console_host,
        "may_stop": deployment.state in ACTIVE_STATES
        and deployment.state != DeploymentState.STOPPING
        and not on_console_host,
        "may_restart": deployment.state in (DeploymentState.RUNNING, DeploymentState.DEGRADED)
        and not on_console_host,
        "may_redeploy": deployment.state in REDEPLOYABLE_STATES and not on_console_host,
        "may_delete": deployment.state in lifecycle.DELETABLE_STATES,
        # This deployment's earlier deploy runs (Redeploy and Restart start a new run of the same one).
        "earlier_runs": deploy_runs[1:],
        "self_heal_limit": settings.RAMDECK_SELF_HEAL_ATTEMPTS,
        **rpc_mode_context(deployment),
        # The same plan's earlier and later runs: what this one was redeployed from, and its redeploys.
        "history": Deployment.objects.filter(
            Q(redeployed_from=deployment) | Q(pk=deployment.redeployed_from_id or 0)
        ).order_by("-created_at")[:10],
    }


def rpc_mode_context(deployment: Deployment) -> dict:
    """The run page's RPC line: the mode chosen, the one a deploy would use now, and why not, if it cannot."""
    workers = []
    try:
        workers = lifecycle.workers_of(deployment)
        effective = lifecycle.rpc_mode(deployment, workers)
        # Checked (names resolved) only where the form is: not on the polled page of an active deployment.
        active = deployment.state in ACTIVE_STATES
        problem = "" if active else lifecycle.rpc_refusal(deployment, workers)
        # Auto took direct mode: the worker that cannot be tunnelled to says why.
        note = ""
        if deployment.rpc_mode == RpcMode.AUTO and effective == RpcMode.DIRECT:
            others = [w.node for w in workers if w.node.pk != deployment.coordinator_id]
            note = next((n.tunnel_refusal for n in others if n.tunnel_refusal), "")
    except (KeyError, ValueError, IndexError):
        effective, problem, note = "", "", ""
    # One machine (no rpc-server): there is no RPC to choose a way for, so the selector is not shown.
    return {
        "rpc_modes": RpcMode.choices,
        "rpc_effective": effective,
        "rpc_problem": problem,
        "rpc_note": note,
        "has_workers": bool(workers),
    }


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
    return deployment.process_rows(), status.get("metrics") or {}, checked_at


@role_required(VIEWER)
def deployment_processes(request, pk: int):
    """Per-node process status (alive, PID, uptime, memory) and /metrics numbers, as the monitor saw them."""
    deployment = _get_deployment(pk)
    rows, metrics, checked_at = _process_rows(deployment)
    live = deployment.state in (DeploymentState.RUNNING, DeploymentState.DEGRADED)
    now = timezone.now()
    samples = deployment.speed_samples.filter(at__gte=now - sparkline.WINDOW).values_list(
        "at", "tokens_per_s"
    )
    return render(
        request,
        "deployments/lifecycle/processes.html",
        {
            "deployment": deployment,
            "rows": rows,
            # The /metrics numbers in sentences, and the decode speed of the last hour as a small chart.
            "metrics_said": metrics_sentences(metrics) if live else [],
            "speed": sparkline.sparkline(samples, now) if live else None,
            "checked_at": checked_at,
        },
    )


@role_required(CHAT)
def deployment_api_key(request, pk: int):
    """The API key, for the chat role and above (admins only on the console's own host); every reveal is
    audited."""
    deployment = _get_deployment(pk)
    refuse_on_console_host(request, deployment, "API keys of deployments")
    key = deployment.api_key() if deployment.api_key_encrypted else ""
    history.record(request, "deployment.api_key_viewed", deployment)
    context = {
        "deployment": deployment,
        "api_key": key,
        "endpoint": endpoint_url(deployment),
        "model_alias": model_alias(deployment.model_file.name),
        "loopback": is_loopback(deployment),
        "snippets": snippets(deployment, model_alias(deployment.model_file.name)),
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
            "local_refusal": lifecycle.local_refusal(deployment, request.user),
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
            request, "Restarting: it stops, then deploys again (a new run of the same deployment)."
        )
    else:
        messages.error(request, message)
    return redirect("deployments:run", pk=deployment.pk)


@require_POST
@role_required(OPERATOR)
def deployment_recalibrate(request, pk: int):
    """Stop the deployment, calibrate one of its nodes (POST `node`, its name), start the same plan again:
    one run, audited (lifecycle.stop_calibrate_start). Offered on the node page where Calibrate would
    otherwise queue a job sure to fail."""
    deployment = _get_deployment(pk)
    node = Node.objects.filter(name=request.POST.get("node", "")).first()
    started, message = lifecycle.stop_calibrate_start(deployment, node, request.user)
    (messages.success if started else messages.error)(request, message)
    return redirect("deployments:run", pk=deployment.pk)


@require_POST
@role_required(OPERATOR)
def deployment_rpc_mode(request, pk: int):
    """Choose how the coordinator reaches the rpc-servers (llamacpp/rpc_guard.py) before a deploy or a
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
    """Turn self-healing on or off (deployments/lifecycle/healing.py); audited."""
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
    """A new deploy run of this stopped or failed deployment, the same deployment (its earlier runs are
    listed on its page)."""
    deployment = _get_deployment(pk)
    if deployment.state not in REDEPLOYABLE_STATES:
        messages.error(request, "Only a stopped or failed deployment can be redeployed.")
        return redirect("deployments:run", pk=deployment.pk)
    _same, started, message = lifecycle.redeploy(deployment, request.user)
    (messages.success if started else messages.error)(request, message)
    return redirect("deployments:run", pk=deployment.pk)


@role_required(OPERATOR)
def deployment_delete(request, pk: int):
    """Delete asks first, as Stop does: GET shows what goes and what stays; a POST that says `confirm`
    deletes. Refused, with the reason, while the deployment runs (or a run of it is finishing)."""
    deployment = _get_deployment(pk)
    if request.method != "POST" or request.POST.get("confirm") != "yes":
        context = {
            "deployment": deployment,
            "refusal": lifecycle.deletion_refusal(deployment),
            "endpoint": endpoint_url(deployment),
        }
        status = 400 if request.method == "POST" else 200
        return render(request, "deployments/lifecycle/delete_confirm.html", context, status=status)
    deleted, message = lifecycle.delete_deployment(deployment, request.user)
    if not deleted:
        messages.error(request, message)
        return redirect("deployments:run", pk=deployment.pk)
    messages.success(request, message)
    return redirect("deployments:list")
