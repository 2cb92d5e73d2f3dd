"""What the pages say of a deployment is what is true now, with a real llama-server on the console's own host:
after Stop no process is shown alive (even when the monitor looked just before the stop), a llama-server
killed under a running deployment takes it out of "Running deployments" with a sentence and a Restart
button and frees its memory on the dashboard, and the audit history says what happened, when, and who (a
person, or the console itself)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent
from audit.sentences import sentence
from deployments import monitor
from deployments.models import ACTIVE_STATES, Deployment, DeploymentState
from jobs.aio import run_to_completion
from tests.chat_fixtures import deploy, local_deployment, stop
from tests.deploy_fixtures import pid_alive
from tests.factories import UserFactory
from tests.runs import run_deployment, run_stop

pytestmark = [pytest.mark.llamacpp, pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


@pytest.fixture
def admin():
    return UserFactory(username="alice-admin", role="admin")


@pytest.fixture
def browser(admin):
    client = Client()
    client.force_login(admin)
    return client


@pytest.fixture
def deployments_stopped_after(admin, monkeypatch):
    """Whatever the test left running is stopped (by PID, through the console's own stop)."""
    yield
    for deployment in Deployment.objects.filter(state__in=ACTIVE_STATES):
        if deployment.state != DeploymentState.STOPPING:
            stop(deployment, admin, monkeypatch)


def _llama_server(deployment: Deployment) -> dict:
    return deployment.processes[f"llama-server@{deployment.coordinator.name}"]


def _process_cell(html: str) -> str:
    """The Alive cell of llama-server's row in the processes table."""
    row = html.split("<td>llama-server</td>", 1)[1].split("</tr>", 1)[0]
    return row


def test_a_stopped_deployment_shows_no_live_process_even_when_the_monitor_looked_just_before(
    tmp_path, admin, browser, monkeypatch, deployments_stopped_after
):
    deployment = deploy(local_deployment(tmp_path, admin), admin, monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    pid = int(_llama_server(deployment)["pid"])
    processes_url = reverse("deployments:processes", args=[deployment.pk])

    assert monitor.check_deployment(deployment) == ""
    page = browser.get(processes_url).content.decode()
    assert '<span class="badge ok">alive</span>' in _process_cell(page)

    # The monitor looks; the stop ends the processes while it looks; its answer (all alive) comes after.
    check = monitor._prepare(Deployment.objects.get(pk=deployment.pk))
    (seen,) = run_to_completion(lambda: monitor._observe_all([check]))
    assert all(row["alive"] for row in seen.rows)
    deployment = stop(deployment, admin, monkeypatch)
    assert deployment.state == DeploymentState.STOPPED
    assert not pid_alive(pid)
    assert monitor._apply(check.deployment, seen) == ""

    page = browser.get(processes_url).content.decode()
    cell = _process_cell(page)
    assert "alive" not in page.split("<tbody>", 1)[1]
    assert '<span class="badge">ended</span>' in cell and "ended by the console" in cell
    assert "The deployment has ended" in page
    run_page = browser.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert 'id="chat-with-it"' not in run_page

    # A reload later says the same: nothing was left alive on record.
    deployment.refresh_from_db()
    assert [row["alive"] for row in deployment.live_status["processes"]] == [False]

    # The audit history: the person deployed and stopped it; the console saw it running, with the speed it
    # had measured by then, and ended its processes.
    events = {e.action: e for e in AuditEvent.objects.filter(object_id=str(deployment.pk))}
    assert events["deployment.deploy"].actor_name == "alice-admin"
    assert events["deployment.stop"].actor_name == "alice-admin"
    running = events["deployment.running"]
    assert running.actor is None and running.actor_name == "console"
    assert running.changes["decode_tps"] == pytest.approx(deployment.measured_decode_tps)
    text = sentence(running)
    assert text.startswith(f"the console saw deployment {deployment} running: decode tps: ")
    assert "—" not in text
    stopped = events["deployment.stopped"]
    assert stopped.actor is None and sentence(stopped).startswith("the console ended every process of")
    # And in that order: running was written when it ran, before the stop.
    assert running.at < events["deployment.stop"].at < stopped.at


def test_a_killed_llama_server_takes_the_deployment_out_of_running_and_its_memory_off_the_dashboard(
    tmp_path, admin, browser, monkeypatch, deployments_stopped_after
):
    deployment = deploy(local_deployment(tmp_path, admin), admin, monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    assert monitor.check_deployment(deployment) == ""
    dashboard = browser.get(reverse("dashboard"))
    body = dashboard.content.decode()
    assert f'id="dash-deployment-{deployment.pk}"' in body and f'id="dash-down-{deployment.pk}"' not in body
    bar = dashboard.context["gauges"][0]["devices"][0]["bar"]
    held = [seg for seg in bar.segments if seg.label == deployment.name]
    assert held and held[0].bytes > 0
    free_before = dashboard.context["memory"]["free"]

    pid = int(_llama_server(deployment)["pid"])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid)

    reason = monitor.check_deployment(Deployment.objects.get(pk=deployment.pk))
    assert "is not running" in reason
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.DEGRADED

    dashboard = browser.get(reverse("dashboard"))
    body = dashboard.content.decode()
    assert f'id="dash-deployment-{deployment.pk}"' not in body  # not under "Running deployments"
    down = body.split(f'id="dash-down-{deployment.pk}"', 1)[1].split("</li>", 1)[0]
    assert f"{deployment.name} is not working: llama-server on this-box stopped running (noticed at " in down
    assert reverse("deployments:restart", args=[deployment.pk]) in down and ">Restart</button>" in down
    bar = dashboard.context["gauges"][0]["devices"][0]["bar"]
    assert not [seg for seg in bar.segments if seg.label == deployment.name]  # its memory is not held
    assert dashboard.context["memory"]["free"] > free_before
    assert dashboard.context["memory"]["free"] == sum(s.bytes for s in bar.segments if s.kind == "free")

    run_page = browser.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert 'data-serving="no"' in run_page and 'id="chat-with-it"' not in run_page
    assert 'id="restart-button"' in run_page and "stopped running" in run_page.split('id="down-sentence"')[1]
    detail = browser.get(reverse("deployments:detail", args=[deployment.pk])).content.decode()
    assert 'id="chat-link"' not in detail

    degraded = AuditEvent.objects.get(action="deployment.degraded", object_id=str(deployment.pk))
    assert degraded.actor is None and sentence(degraded).startswith("the console's monitor saw deployment")

    # The Restart button: the stop run ends what is left, then the same deployment is deployed again (a new
    # run of it, not a second deployment of the same name).
    monkeypatch.setattr("jobs.models.Job.send_to_worker", lambda job: True)
    response = browser.post(reverse("deployments:restart", args=[deployment.pk]))
    assert response.status_code == 302
    run_stop(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.PREPARING and not deployment.processes
    assert not Deployment.objects.filter(redeployed_from=deployment).exists()
    run_deployment(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    body = browser.get(reverse("dashboard")).content.decode()
    assert f'id="dash-deployment-{deployment.pk}"' in body and "Not working" not in body
