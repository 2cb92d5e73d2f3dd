"""The deployment list and a deployment's detail page."""

from __future__ import annotations

from django.shortcuts import get_object_or_404, render
from django.urls import reverse

from deployments.endpoint import endpoint_url
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from deployments.views.commands import command_lines
from deployments.views.plan import nothing_to_split
from ramdeck_site.roles import VIEWER, can_operate, role_required


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
        "commands": command_lines(deployment.model_file, plan, deployment) if plan.get("fits") else None,
        "run_url": reverse("deployments:run", args=[pk]),
        "speed_reasons": deployment.speed_miss_reasons(),
        "endpoint": endpoint_url(deployment),
        "one_machine": nothing_to_split(plan),
        **next_step(request.user, deployment),
    }
    return render(request, "deployments/deployment_detail.html", context)


def next_step(user, deployment: Deployment) -> dict:
    """A confirmed deployment's next step, for the page Confirm leads to: the Deploy button, or why this
    user cannot press it (the same checks Deploy makes, without touching a node)."""
    if deployment.state != DeploymentState.CONFIRMED or not can_operate(user):
        return {"offer_deploy": False, "deploy_refusal": ""}
    reason = lifecycle.local_refusal(deployment, user) or lifecycle.refusal(deployment)
    return {"offer_deploy": True, "deploy_refusal": reason}
