"""A node's llama.cpp builds: the page that lists them and the form that starts one."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from audit import history
from builds import checks as build_checks
from builds.forms import BuildForm, default_tarball
from jobs.models import Job, refuse_local_node
from nodes.models import Node
from ramdeck_site.roles import OPERATOR, VIEWER, can_operate, role_required


def _build_page(request, node: Node, form: BuildForm, status: int = 200):
    return render(
        request,
        "builds/builds.html",
        {
            "node": node,
            "builds": node.builds.all()[:20],
            "jobs": Job.objects.filter(node=node, kind="build").select_related("node")[:10],
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
