"""Confirm leads straight to Deploy: "Confirm and deploy" on the plan page does both in one transaction with
the Deploy button's checks (a refusal leaves nothing confirmed), and after a plain Confirm the next page
offers Deploy, or says why this user cannot."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent
from builds.models import Build, BuildSource
from deployments.models import Deployment, DeploymentState, ResourceClaim
from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db

PLAN = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7, "full": "1"}


def _builds(*nodes) -> None:
    for node in nodes:
        Build.objects.create(
            node=node,
            source_kind=BuildSource.EXISTING,
            rpc_protocol="7.0.0",
            rpc_server_path="/opt/llama/ggml-rpc-server",
            llama_server_path="/opt/llama/llama-server",
        )


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _plan_page(client, model) -> str:
    query = {k: v for k, v in PLAN.items() if k != "full"}
    return client.get(reverse("deployments:plan", args=[model.pk]), query).content.decode()


def test_confirm_and_deploy_confirms_and_starts_the_run_in_one_step(
    model, pool, admin_user, no_enqueue, django_capture_on_commit_callbacks
):
    _builds(pool["desk"], pool["pc"])
    client = _client(admin_user)
    page = _plan_page(client, model)
    assert 'id="confirm-deploy" type="submit" form="confirm-form" name="then" value="deploy"' in page
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("deployments:confirm", args=[model.pk]),
            {**PLAN, "then": "deploy", "confirm_token": "abc1"},
        )
    deployment = Deployment.objects.get()
    assert response.status_code == 302, response.content.decode()[:3000]
    assert response["Location"] == reverse("deployments:run", args=[deployment.pk])
    assert deployment.state == DeploymentState.PREPARING and deployment.confirm_token == "abc1"
    run = Job.objects.get(kind="deploy", params__deployment=deployment.pk)
    assert run.state == JobState.QUEUED and deployment.steps.count() >= 4
    assert no_enqueue == [("deploy", deployment.pk)]  # sent to a worker once the transaction committed
    assert ResourceClaim.objects.filter(deployment=deployment, resource=f"port:{deployment.port}").exists()
    actions = list(AuditEvent.objects.order_by("pk").values_list("action", flat=True))
    assert actions[-2:] == ["deployment.confirm", "deployment.deploy"]
    # The same form sent again (a double click) finds it and starts nothing more.
    again = client.post(
        reverse("deployments:confirm", args=[model.pk]), {**PLAN, "then": "deploy", "confirm_token": "abc1"}
    )
    assert again.status_code == 302 and Deployment.objects.count() == 1
    assert Job.objects.filter(kind="deploy").count() == 1


def test_a_refused_confirm_and_deploy_confirms_nothing_and_says_why(
    model, pool, admin_user, no_enqueue, django_capture_on_commit_callbacks
):
    # No llama.cpp build on the coordinator (the plan is desk's alone: the form ticks no other node).
    client = _client(admin_user)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = client.post(reverse("deployments:confirm", args=[model.pk]), {**PLAN, "then": "deploy"})
    assert callbacks == []  # nothing left to send when the transaction was rolled back
    assert response.status_code == 409
    page = response.content.decode()
    assert "Not deployed, and nothing was confirmed: desk has no llama.cpp build" in page
    assert not Deployment.objects.exists() and not Job.objects.exists() and no_enqueue == []
    assert not ResourceClaim.objects.exists()
    refused = AuditEvent.objects.get(action="deployment.refused")
    assert refused.object_type == "modelfile" and "desk has no llama.cpp build" in refused.changes["reason"]
    assert not AuditEvent.objects.filter(action__in=["deployment.confirm", "deployment.deploy"]).exists()


def test_an_operator_is_not_offered_confirm_and_deploy_on_the_consoles_own_host(
    model, pool, operator_user, no_enqueue
):
    _builds(pool["desk"], pool["pc"])
    client = _client(operator_user)
    page = _plan_page(client, model)
    assert 'id="confirm-plan"' in page and 'id="confirm-deploy"' not in page
    assert "desk is the console&#x27;s own host: after you confirm, an admin deploys it." in page
    # Posted anyway: refused by the same check Deploy makes, nothing confirmed.
    response = client.post(reverse("deployments:confirm", args=[model.pk]), {**PLAN, "then": "deploy"})
    assert response.status_code == 409 and "needs the admin role" in response.content.decode()
    assert not Deployment.objects.exists() and no_enqueue == []


def test_after_a_plain_confirm_the_next_page_offers_deploy(
    model, pool, admin_user, no_enqueue, django_capture_on_commit_callbacks
):
    _builds(pool["desk"], pool["pc"])
    client = _client(admin_user)
    response = client.post(reverse("deployments:confirm", args=[model.pk]), PLAN, follow=True)
    deployment = Deployment.objects.get()
    assert deployment.state == DeploymentState.CONFIRMED and no_enqueue == []
    assert response.redirect_chain[-1][0] == deployment.get_absolute_url()
    page = response.content.decode()
    assert 'id="next-step"' in page and "Deploy it when you are ready" in page
    form = re.search(
        r'<form method="post" action="([^"]+)">[^<]*<input[^>]+>\s*<button[^>]*id="deploy-button"', page
    )
    assert form and form.group(1) == reverse("deployments:deploy", args=[deployment.pk])
    # Pressed: the run starts and the run page follows.
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(form.group(1))
    assert response.status_code == 302 and response["Location"] == reverse(
        "deployments:run", args=[deployment.pk]
    )
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.PREPARING and no_enqueue == [("deploy", deployment.pk)]
    # Deploying: the next-step panel is gone.
    assert 'id="next-step"' not in client.get(deployment.get_absolute_url()).content.decode()


def test_the_next_page_says_why_deploy_is_not_offered(model, pool, admin_user, operator_user, viewer_user):
    assert _client(admin_user).post(reverse("deployments:confirm", args=[model.pk]), PLAN).status_code == 302
    deployment = Deployment.objects.get()
    admin_page = _client(admin_user).get(deployment.get_absolute_url()).content.decode()
    assert 'id="deploy-refusal"' in admin_page and "desk has no llama.cpp build" in admin_page
    assert 'id="deploy-button"' not in admin_page
    operator_page = _client(operator_user).get(deployment.get_absolute_url()).content.decode()
    assert "needs the admin role" in operator_page and 'id="deploy-button"' not in operator_page
    viewer_page = _client(viewer_user).get(deployment.get_absolute_url()).content.decode()
    assert 'id="next-step"' not in viewer_page
