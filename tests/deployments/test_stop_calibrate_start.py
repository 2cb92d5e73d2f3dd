"""Calibrating a node that a running deployment uses: the node page offers "Stop it, calibrate, start again"
(one run: undeploy, calibrate, deploy the same plan again; audited) instead of a Calibrate button whose job
would fail at once, and no page or button ever queues a calibration that is sure to fail. The whole run with
real llama.cpp on the console's own host is the last test."""

from __future__ import annotations

import pytest
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent
from builds.models import Build
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState, ResourceClaim
from jobs.models import Job, JobState
from modelfiles.models import ModelFile
from tests.factories import DeviceFactory, NodeFactory


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    """Jobs are not sent to a worker here; the pks that would have been."""
    pks: list[int] = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: pks.append(job.pk))
    return pks


def _busy_node(state=DeploymentState.RUNNING):
    """pc, with a build and a device, serving the running deployment "chat"."""
    node = NodeFactory(name="pc", address="10.77.1.5")
    Build.objects.create(node=node, source_kind="existing", rpc_server_path="/r", llama_server_path="/l")
    DeviceFactory(node=node, name="CPU")
    model = ModelFile.objects.create(name="m", node=node, path="/m.gguf", profile={})
    deployment = Deployment.objects.create(
        name="chat", model_file=model, coordinator=node, plan={}, state=state
    )
    ResourceClaim.objects.create(node=node, resource="port:8080", deployment=deployment)
    return node, deployment


def _said(response) -> str:
    return " ".join(str(m) for m in get_messages(response.wsgi_request))


@pytest.mark.django_db
def test_a_busy_node_offers_stop_calibrate_start_and_never_queues_a_calibration_sure_to_fail(
    operator_client, sent, django_capture_on_commit_callbacks
):
    node, deployment = _busy_node()
    page = operator_client.get(node.get_absolute_url()).content.decode()
    assert 'id="stop-calibrate-start"' in page and "Stop chat, calibrate, start again" in page
    assert f'action="{reverse("deployments:recalibrate", args=[deployment.pk])}"' in page
    assert "pc serves chat: a calibration needs its ports" in page
    assert f'action="{reverse("calibration:node", args=["pc"])}"' not in page
    # Asked for anyway (an old page, a script): refused with the reason, and no job to fail.
    response = operator_client.post(reverse("calibration:node", args=["pc"]))
    assert response.status_code == 302 and "pc serves deployment chat" in _said(response)
    response = operator_client.post(reverse("calibration:all"))
    assert "Not calibrated: pc (serves chat)" in _said(response)
    assert not Job.objects.filter(kind="calibrate").exists()

    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(
            reverse("deployments:recalibrate", args=[deployment.pk]), {"node": "pc"}
        )
    assert response.status_code == 302 and response.url == reverse("deployments:run", args=[deployment.pk])
    assert "Stopping chat, then calibrating pc, then starting the same plan again." in _said(response)
    run = Job.objects.get(kind="recalibrate")
    assert run.params["calibrate"] == node.pk and run.params["deployment"] == deployment.pk
    assert run.title == "Stop chat, calibrate pc, start again" and sent == [run.pk]
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPING
    event = AuditEvent.objects.get(action="deployment.recalibrate")
    assert event.changes == {"node": "pc", "run": run.pk} and event.actor_name == "oscar-operator"
    # Pressed twice (or Stop meanwhile): one run, the second press says why.
    response = operator_client.post(reverse("deployments:recalibrate", args=[deployment.pk]), {"node": "pc"})
    assert "chat is stopping" in _said(response)
    response = operator_client.post(reverse("deployments:stop", args=[deployment.pk]), {"confirm": "yes"})
    assert "being stopped to calibrate a node" in _said(response)
    assert Job.objects.filter(kind__in=["recalibrate", "undeploy"]).count() == 1


@pytest.mark.django_db
def test_a_node_that_cannot_be_calibrated_says_why_next_to_a_disabled_button(operator_client, sent):
    node = NodeFactory(name="new-pc")
    DeviceFactory(node=node, name="CPU")
    page = operator_client.get(node.get_absolute_url()).content.decode()
    assert (
        '<button type="button" class="button secondary small" id="calibrate-now" disabled>Calibrate</button>'
        in page
    )
    assert "new-pc has no llama.cpp build: build or register one on its page first." in page
    response = operator_client.post(reverse("calibration:node", args=["new-pc"]))
    assert "new-pc has no llama.cpp build" in _said(response) and not Job.objects.exists()
    # A deployment that is not running is no reason to offer the combined run.
    _node, deployment = _busy_node(state=DeploymentState.PREPARING)
    ok, message = lifecycle.stop_calibrate_start(deployment, _node)
    assert not ok and message == "chat is preparing: calibrate pc from its own page."
    ok, message = lifecycle.stop_calibrate_start(deployment, node)
    assert not ok and message == "Choose a node this deployment uses."
    assert not Job.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["viewer", "chat"])
def test_viewers_and_the_chat_role_see_no_calibration_and_are_refused_it(role, sent):
    from tests.factories import UserFactory

    node, deployment = _busy_node()
    client = Client()
    client.force_login(UserFactory(username=f"u-{role}", role=role))
    page = client.get(node.get_absolute_url()).content.decode()
    for offer in ('id="calibrate-now"', 'id="stop-calibrate-start"', "/recalibrate/", "/calibrate/"):
        assert offer not in page
    url = reverse("deployments:recalibrate", args=[deployment.pk])
    assert client.post(url, {"node": "pc"}).status_code == 403
    assert not Job.objects.exists()


@pytest.mark.llamacpp
@pytest.mark.timeout(1800)
@pytest.mark.django_db(transaction=True)
def test_stop_calibrate_start_is_one_run_that_brings_the_same_plan_back_with_real_llama_cpp(
    tmp_path, admin_user, monkeypatch, settings
):
    from tests.chat_fixtures import deploy, local_deployment, stop, wait_until_port_free
    from tests.deploy_fixtures import log_text
    from tests.runs import run_deployment, run_latest

    settings.VAR_DIR = tmp_path  # the calibration's generated models
    deployment = deploy(local_deployment(tmp_path, admin_user), admin_user, monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, deployment.state_reason
    node = deployment.coordinator
    assert node.calibrated_at is None

    # The calibration starts an rpc-server on this node's RPC port, which an earlier test's may still hold.
    wait_until_port_free(node.rpc_port)
    ok, message = lifecycle.stop_calibrate_start(deployment, node, admin_user)
    assert ok, message
    run = run_latest(deployment.pk, lifecycle.RECALIBRATE)
    assert run.state == JobState.SUCCEEDED, (run.result, log_text(run)[-3000:])
    deployment.refresh_from_db()
    # Started again as Redeploy does: a new deploy run of the same deployment, queued, its claims taken again.
    assert deployment.state == DeploymentState.PREPARING and deployment.claims.exists()
    assert not Deployment.objects.filter(redeployed_from=deployment).exists()
    steps = [
        (s.name, s.job.state, s.job.parent_id)
        for s in deployment.steps.order_by("order")
        if s.job.parent_id == run.pk
    ]
    assert [name for name, _, _ in steps] == ["stop", "calibrate"], steps
    assert all(state == JobState.SUCCEEDED for _, state, _ in steps), steps
    node.refresh_from_db()
    assert node.calibrated_at is not None and node.devices.get(name="CPU").measured_at is not None
    # Never a calibration that failed at once: the only one is the run's own step.
    assert Job.objects.filter(kind="calibrate").count() == 1

    assert run.result == f"Stopped, calibrated {node.name}, started again as {deployment}."
    run_deployment(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING, deployment.state_reason
    actions = list(AuditEvent.objects.order_by("pk").values_list("action", flat=True))
    recalibrated = actions.index("deployment.recalibrate")
    assert actions.index("deployment.stopped", recalibrated) < actions.index(
        "deployment.redeploy", recalibrated
    )
    assert stop(deployment, admin_user, monkeypatch).state == DeploymentState.STOPPED
