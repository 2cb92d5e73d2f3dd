"""Where llama-server listens is chosen with the plan (deployments/endpoint.py): loopback by default on the
console's own host, the coordinator's LAN address otherwise, stored on the deployment, errors on the form."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from deployments.models import Deployment, DeploymentState, ResourceClaim

pytestmark = pytest.mark.django_db

PLAN = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7, "full": "1"}


def _plan_page(client, model, **extra) -> str:
    query = {k: v for k, v in PLAN.items() if k != "full"} | extra
    return client.get(reverse("deployments:plan", args=[model.pk]), query).content.decode()


def _confirm(client, model, **extra):
    return client.post(reverse("deployments:confirm", args=[model.pk]), {**PLAN, **extra})


def test_on_the_consoles_own_host_the_endpoint_is_loopback_unless_chosen_otherwise(model, operator_client):
    page = _plan_page(operator_client, model)
    assert 'id="reach-loopback" checked' in page
    assert 'This machine only (127.0.0.1)</strong> <span class="muted">(recommended)</span>' in page
    assert 'form="confirm-form"' in page and 'name="port"' in page and 'value="8080"' in page
    response = _confirm(operator_client, model)
    assert response.status_code == 302
    deployment = Deployment.objects.get()
    assert (deployment.host, deployment.port) == ("127.0.0.1", 8080)
    event = AuditEvent.objects.get(action="deployment.confirm")
    assert event.changes["endpoint"] == "127.0.0.1:8080"


def test_the_consoles_host_can_open_its_endpoint_to_the_network_on_another_port(model, operator_client):
    response = _confirm(operator_client, model, reach="all", port="9090")
    assert response.status_code == 302
    deployment = Deployment.objects.get()
    assert (deployment.host, deployment.port) == ("0.0.0.0", 9090)
    detail = operator_client.get(deployment.get_absolute_url()).content.decode()
    assert "--alias tiny --host 0.0.0.0 --port 9090" in detail


def test_a_coordinator_on_the_lan_listens_on_its_own_address_by_default(model, pool, operator_client):
    pool["pc"].may_coordinate = True
    pool["pc"].save()
    page = _plan_page(operator_client, model, coordinator=pool["pc"].pk)
    assert 'id="reach-lan" checked' in page and "Your network, at 10.77.0.2" in page
    assert 'id="reach-loopback"' not in page  # the console could not reach it there
    assert "Loopback is not offered" in page
    both = [pool["pc"].pk, pool["desk"].pk]
    response = _confirm(operator_client, model, coordinator=pool["pc"].pk, nodes=both)
    assert response.status_code == 302
    deployment = Deployment.objects.get()
    assert deployment.coordinator == pool["pc"] and deployment.host == "10.77.0.2"
    # Loopback sent anyway (an old form, a crafted post) is an error, not quietly replaced.
    response = _confirm(operator_client, model, coordinator=pool["pc"].pk, nodes=both, reach="loopback")
    assert response.status_code == 400 and Deployment.objects.count() == 1
    assert "Choose the endpoint again" in response.content.decode()


@pytest.mark.parametrize(
    ("port", "message"),
    [
        ("80", "greater than or equal to 1024"),
        ("50052", "ggml-rpc-server port; choose another"),
        ("x", "whole number"),
    ],
)
def test_a_bad_port_is_a_form_error_and_confirms_nothing(model, operator_client, port, message):
    response = _confirm(operator_client, model, port=port)
    assert response.status_code == 400
    page = response.content.decode()
    assert message in page and 'class="field has-error"' in page
    assert not Deployment.objects.exists()


def test_a_port_an_active_deployment_holds_is_refused_and_the_default_moves_past_it(model, operator_client):
    assert _confirm(operator_client, model).status_code == 302
    first = Deployment.objects.get()
    Deployment.objects.filter(pk=first.pk).update(state=DeploymentState.RUNNING)
    ResourceClaim.objects.create(node=first.coordinator, resource="port:8080", deployment=first)
    response = _confirm(operator_client, model, port="8080")
    assert response.status_code == 400
    assert f"Port 8080 on desk is held by deployment {first}" in response.content.decode()
    assert 'value="8081"' in _plan_page(operator_client, model)
    assert _confirm(operator_client, model).status_code == 302
    assert Deployment.objects.exclude(pk=first.pk).get().port == 8081


def test_viewers_see_no_endpoint_choice(model, viewer_client):
    page = _plan_page(viewer_client, model)
    assert "plan-form" in page and 'id="endpoint-choice"' not in page
