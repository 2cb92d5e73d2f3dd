"""The deployment list and a deployment's detail page."""

from __future__ import annotations

from django.shortcuts import get_object_or_404, render
from django.urls import reverse

from deployments.endpoint import endpoint_url
from deployments.models import Deployment
from deployments.views.plan import command_lines, nothing_to_split
from ramdeck_site.roles import VIEWER, role_required


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
    }
    return render(request, "deployments/deployment_detail.html", context)
