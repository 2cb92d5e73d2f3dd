"""The "Add this machine" button: the console's own host as a node in one click (the first-run path).

It becomes a Local node (the local transport runs commands as the console's own user, next to its secrets,
so only an admin may add it) that may coordinate, a probe starts at once, and a llama.cpp install the probe
finds is recorded as a build (nodes/probe/job.py). The same machine is never added twice: its memory would
count twice in every plan.
"""

from __future__ import annotations

import socket

from django.contrib import messages
from django.db import transaction
from django.shortcuts import redirect
from django.utils.text import slugify
from django.views.decorators.http import require_POST

from audit import history
from nodes.forms import same_machine_message
from nodes.models import Node, Transport
from nodes.probe.job import start_probe
from ramdeck_site.roles import ADMIN, role_required

FALLBACK_NAME = "this-machine"


def name_for_this_machine() -> str:
    """The host's name as a node name (a slug), unless a node already has it."""
    name = slugify(socket.gethostname().split(".")[0])[:100] or FALLBACK_NAME
    if Node.objects.filter(name=name).exists():
        name = FALLBACK_NAME
    return name


@role_required(ADMIN)
@require_POST
def add_this_machine(request):
    with transaction.atomic():
        local = Node.objects.select_for_update().filter(transport=Transport.LOCAL).first()
        if local is not None:
            messages.error(request, same_machine_message(local))
            return redirect(local)
        name = name_for_this_machine()
        if Node.objects.filter(name=name).exists():
            messages.error(
                request, f"A node is already named {name}; rename it, or add this machine by hand."
            )
            return redirect("nodes:create")
        node = Node.objects.create(
            name=name, address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True
        )
        history.record(
            request,
            "node.create",
            node,
            changes={"transport": "local", "address": node.address, "may_coordinate": True},
        )
        job = start_probe(node, user=request.user, register_detected=True)
        history.record(request, "node.probe", node, changes={"job": job.pk})
    messages.success(
        request,
        f"This machine is node {node.name}. Probing its hardware; a llama.cpp install it finds is recorded "
        "as a build.",
    )
    return redirect(node)
