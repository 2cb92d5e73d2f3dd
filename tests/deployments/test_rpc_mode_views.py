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


def test_a_windows_worker_says_why_it_gets_no_tunnel_on_the_run_page_and_its_node_page(
    operator_client, deployment, no_enqueue
):
    """Auto takes direct mode for a Windows worker and the run page says why; a tunnel asked for is refused
    with the same sentence before anything starts; the node page says it too."""
    from nodes.models import Node

    worker = Node.objects.get(name=deployment.plan["placements"][0]["node"])
    worker.facts = {**(worker.facts or {}), "platform": "windows"}  # what its probe found
    worker.save()
    why = "where the console cannot set up the RPC tunnel yet"
    run_url = reverse("deployments:run", args=[deployment.pk])

    page = operator_client.get(run_url).content.decode()
    note = page.split('id="rpc-mode-note"', 1)[1].split("</span>", 1)[0]
    assert "direct on the LAN" in page and why in note and "administrators_authorized_keys" in note
    assert "Windows Firewall then admits only the coordinator" in note

    Deployment.objects.filter(pk=deployment.pk).update(rpc_mode="tunnel")
    deployment.refresh_from_db()
    page = operator_client.get(run_url).content.decode()
    problem = page.split('id="rpc-mode-problem"', 1)[1].split("</strong>", 1)[0]
    assert problem.startswith(f">{worker.name} runs Windows, {why}")
    started, reason = lifecycle.start_deploy(deployment)
    assert not started and reason == worker.tunnel_refusal and why in reason

    node_page = operator_client.get(worker.get_absolute_url()).content.decode()
    line = node_page.split('id="rpc-tunnel"', 1)[1].split("</dd>", 1)[0]
    assert why in line and "Choose direct mode" in line
    assert 'id="platform">Windows<' in node_page
