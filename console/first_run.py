"""The dashboard's first-run checklist: the steps from an empty console to a model that answers.

`checklist(state)` is pure: it turns a `FirstRunState` (facts about the database, gathered by
`gather_state()`) into the steps, each done or not, each with the page that does it. The dashboard shows
the list until every step is done (templates/ramdeck_site/_first_run.html).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.urls import reverse

from builds.models import Build
from deployments.models import Deployment
from modelfiles.models import ModelFile
from nodes.models import Credential, Node, Transport


@dataclass(frozen=True)
class FirstRunState:
    has_credential: bool = False
    has_local_node: bool = False
    has_node: bool = False
    # The first node whose host key waits for an admin (its name), else "".
    node_awaiting_key: str = ""
    # Some node may run jobs: a local node, or an SSH node with an approved key.
    has_trusted_node: bool = False
    has_probed_node: bool = False
    has_build: bool = False
    # Some node has calibration figures (calibration/: queued by itself after a node's first build).
    has_calibrated_node: bool = False
    has_model: bool = False
    has_deployment: bool = False
    has_run_deployment: bool = False
    has_answering_deployment: bool = False
    # Where the next step of each kind happens (a node's name, a model's or deployment's pk), if any.
    first_node: str = ""
    node_without_build: str = ""
    # The first node with a build and no calibration yet: where the Calibrate button is.
    node_without_calibration: str = ""
    first_model: int | None = None
    first_deployment: int | None = None
    # The node the small real model would go to (one with a build, else any the console may act on): its pk.
    real_model_node: int | None = None


@dataclass(frozen=True)
class Step:
    key: str
    title: str
    done: bool
    url: str
    action: str
    # A POST button (its form) rather than a link: "Add this machine".
    post: bool = False
    help: str = ""
    # The model step's second way: a POST that brings the small real model onto this node (its pk).
    real_model_node: int | None = None


def checklist(state: FirstRunState) -> list[Step]:
    node_page = (
        reverse("nodes:detail", args=[state.first_node]) if state.first_node else reverse("nodes:list")
    )
    key_page = (
        reverse("nodes:detail", args=[state.node_awaiting_key]) if state.node_awaiting_key else node_page
    )
    build_node = state.node_without_build or state.first_node
    calibrate_node = state.node_without_calibration or state.first_node
    calibrate_page = (
        reverse("nodes:detail", args=[calibrate_node]) if calibrate_node else reverse("nodes:list")
    )
    builds_page = reverse("builds:node", args=[build_node]) if build_node else reverse("nodes:list")
    plan_page = (
        reverse("deployments:plan", args=[state.first_model])
        if state.first_model
        else reverse("modelfiles:list")
    )
    run_page = (
        reverse("deployments:run", args=[state.first_deployment])
        if state.first_deployment
        else reverse("deployments:list")
    )
    return [
        Step(
            "credential",
            "A way in: an SSH credential, or this machine",
            state.has_credential or state.has_local_node,
            reverse("nodes:add_this_machine") if not state.has_credential else reverse("nodes:credentials"),
            "Add this machine",
            post=not state.has_credential,
            help="Or add an SSH credential (the console can generate the key pair) for other machines.",
        ),
        Step("node", "A node", state.has_node, reverse("nodes:create"), "Add a node"),
        Step(
            "host_key",
            "Its SSH host key approved",
            # One node the console may act on is enough to go on; later keys show under "Needs attention".
            state.has_trusted_node,
            key_page,
            "Approve the host key",
            help="The console's own machine needs none.",
        ),
        Step("probe", "Its hardware probed", state.has_probed_node, node_page, "Probe it"),
        Step(
            "build", "llama.cpp recorded", state.has_build, builds_page, "Build or use the detected install"
        ),
        Step(
            "calibrated",
            "Its speed measured (calibrated)",
            state.has_calibrated_node,
            calibrate_page,
            "Calibrate it",
            help="It starts by itself once a node's first build is recorded, and takes about a minute; until "
            "then plans guess each device's speed from a table.",
        ),
        Step(
            "model",
            "A GGUF model",
            state.has_model,
            reverse("modelfiles:list"),
            "Register a model",
            real_model_node=state.real_model_node,
        ),
        Step("plan", "A plan confirmed", state.has_deployment, plan_page, "Plan and confirm"),
        Step("deploy", "Deployed and running", state.has_run_deployment, run_page, "Deploy"),
        Step("chat", "The model answered", state.has_answering_deployment, run_page, "Talk to it"),
    ]


def gather_state() -> FirstRunState:
    """The facts `checklist` needs, in a handful of queries."""

    nodes = Node.objects.filter(enabled=True)
    awaiting = nodes.exclude(pending_host_key="").values_list("name", flat=True).first() or ""
    trusted = nodes.filter(transport=Transport.LOCAL) | nodes.exclude(host_key="")
    without_build = (
        nodes.filter(builds__isnull=True, last_seen_at__isnull=False).values_list("name", flat=True).first()
    )
    without_calibration = (
        nodes.filter(builds__isnull=False, calibrated_at__isnull=True)
        .order_by("created_at", "pk")
        .values_list("name", flat=True)
        .first()
    )
    model = ModelFile.objects.order_by("created_at", "pk").values_list("pk", flat=True).first()
    deployments = Deployment.objects.order_by("-created_at", "-pk")
    built = trusted.filter(builds__isnull=False).order_by("created_at", "pk").values_list("pk", flat=True)
    real_model_node = (
        built.first() or trusted.order_by("created_at", "pk").values_list("pk", flat=True).first()
    )
    return FirstRunState(
        has_credential=Credential.objects.exists(),
        has_local_node=nodes.filter(transport=Transport.LOCAL).exists(),
        has_node=nodes.exists(),
        node_awaiting_key=awaiting,
        has_trusted_node=trusted.exists(),
        has_probed_node=nodes.filter(last_seen_at__isnull=False).exists(),
        has_build=Build.objects.filter(node__enabled=True).exists(),
        has_calibrated_node=nodes.filter(calibrated_at__isnull=False).exists(),
        has_model=model is not None,
        has_deployment=deployments.exists(),
        has_run_deployment=deployments.filter(running_at__isnull=False).exists(),
        # The chat box got an answer from a deployment (not the measure step's request: a person asked).
        has_answering_deployment=deployments.filter(chat_answered_at__isnull=False).exists(),
        first_node=nodes.order_by("created_at", "pk").values_list("name", flat=True).first() or "",
        node_without_build=without_build or "",
        node_without_calibration=without_calibration or "",
        first_model=model,
        first_deployment=deployments.values_list("pk", flat=True).first(),
        real_model_node=real_model_node,
    )


def first_run_context(user) -> dict:
    """The dashboard's `first_run` (the steps) and `first_run_done`; no steps for a finished console."""
    steps = checklist(gather_state())
    done = all(step.done for step in steps)
    return {"first_run": [] if done else steps, "first_run_done": sum(step.done for step in steps)}
