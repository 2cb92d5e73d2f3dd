"""The deployment's RPC mode on its run page: shown, chosen by an operator before a deploy, audited, and a
mode that cannot work named before anything starts."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState

pytestmark = pytest.mark.django_db


def test_the_run_page_shows_the_tunnel_an_auto_deployment_will_use(operator_client, deployment):
    page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert "SSH tunnel: the rpc-servers listen on 127.0.0.1" in page and "(auto)" in page
    assert 'id="rpc-mode-form"' in page


def test_an_operator_chooses_direct_and_it_is_audited(operator_client, deployment):
    url = reverse("deployments:rpc_mode", args=[deployment.pk])
    response = operator_client.post(url, {"mode": "direct"}, follow=True)
    deployment.refresh_from_db()
    assert deployment.rpc_mode == "direct"
    assert "direct on the LAN" in response.content.decode()
    event = AuditEvent.objects.get(action="deployment.rpc_mode")
    assert event.changes == {"rpc_mode": ["auto", "direct"]}
    bad = operator_client.post(url, {"mode": "telnet"}, follow=True).content.decode()
    assert "Choose auto, tunnel or direct." in bad


def test_a_worker_that_refuses_tunnels_makes_auto_direct_and_a_forced_tunnel_is_refused(
    operator_client, deployment, no_enqueue
):
    worker = deployment.plan["placements"][0]["node"]
    from nodes.models import Node

    Node.objects.filter(name=worker).update(rpc_tunnel=False)
    assert lifecycle.rpc_mode(deployment) == "direct"
    Deployment.objects.filter(pk=deployment.pk).update(rpc_mode="tunnel")
    deployment.refresh_from_db()
    page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert "does not allow RPC tunnels" in page
    started, reason = lifecycle.start_deploy(deployment)
    assert not started and "does not allow RPC tunnels" in reason


def test_an_ipv6_worker_cannot_be_deployed_direct(deployment, no_enqueue):
    from nodes.models import Node

    worker = Node.objects.get(name=deployment.plan["placements"][0]["node"])
    worker.rpc_bind_address = "fd00::5"
    worker.save()
    Deployment.objects.filter(pk=deployment.pk).update(rpc_mode="direct")
    deployment.refresh_from_db()
    started, reason = lifecycle.start_deploy(deployment)
    assert not started and "listens on IPv4 only" in reason
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.CONFIRMED


def test_the_mode_of_an_active_deployment_stays_until_it_stops(operator_client, deployment, no_enqueue):
    assert lifecycle.start_deploy(deployment)[0]
    response = operator_client.post(
        reverse("deployments:rpc_mode", args=[deployment.pk]), {"mode": "direct"}, follow=True
    )
    assert "Stop the deployment first" in response.content.decode()
    deployment.refresh_from_db()
    assert deployment.rpc_mode == "auto"
