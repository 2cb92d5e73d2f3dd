"""The node hardware panel, "probe now", and host-key approval."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs.models import Job, JobState
from nodes.models import Reachability
from tests.factories import DeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db

OLD_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOldOldOldOldOldOldOldOldOldOldOldOldOldOld"
NEW_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINewNewNewNewNewNewNewNewNewNewNewNewNewNew"
OLD_FP = "SHA256:oldoldoldoldoldoldoldoldoldoldoldoldoldold1"
NEW_FP = "SHA256:newnewnewnewnewnewnewnewnewnewnewnewnewnew1"


@pytest.fixture(autouse=True)
def no_broker(monkeypatch):
    """Jobs are queued on commit; here the queue is a list instead of Redis."""
    sent: list[int] = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: sent.append(job.pk))
    return sent


def pending_node(**fields):
    return NodeFactory(pending_host_key=NEW_KEY, pending_host_key_fingerprint=NEW_FP, **fields)


def changed_node():
    return pending_node(
        host_key=OLD_KEY, host_key_fingerprint=OLD_FP, reachability=Reachability.HOST_KEY_CHANGED
    )


def approve(client, node, fingerprint=NEW_FP):
    return client.post(reverse("nodes:approve_host_key", args=[node.name]), {"fingerprint": fingerprint})


def test_admin_approves_a_first_contact_key_and_a_probe_is_queued(
    admin_client, admin_user, no_broker, django_capture_on_commit_callbacks
):
    node = pending_node(reachability=Reachability.HOST_KEY_PENDING)
    with django_capture_on_commit_callbacks(execute=True):
        response = approve(admin_client, node)
    assert response.status_code == 302
    node.refresh_from_db()
    assert (node.host_key, node.host_key_fingerprint) == (NEW_KEY, NEW_FP)
    assert (node.pending_host_key, node.pending_host_key_fingerprint) == ("", "")
    assert node.host_key_approved_by == admin_user and node.host_key_approved_at
    assert node.reachability == Reachability.UNKNOWN
    event = AuditEvent.objects.get(action="node.host_key.approve")
    assert event.changes == {"host_key_fingerprint": ["", NEW_FP], "replaced": False}
    assert event.actor == admin_user and event.object_id == str(node.pk)
    probe = Job.objects.get(node=node, kind="probe")
    assert no_broker == [probe.pk]
    # That first probe over the trusted connection records a llama.cpp it finds (the compose trial's nodes).
    assert probe.params == {"register_detected": True}


def test_approving_a_changed_key_replaces_the_old_one_and_audits_both(admin_client):
    node = changed_node()
    approve(admin_client, node)
    node.refresh_from_db()
    assert node.host_key == NEW_KEY and node.last_error == ""
    event = AuditEvent.objects.get(action="node.host_key.approve")
    assert event.changes == {"host_key_fingerprint": [OLD_FP, NEW_FP], "replaced": True}


def test_a_key_that_changed_after_the_page_was_shown_is_not_approved(admin_client):
    node = changed_node()
    response = approve(admin_client, node, fingerprint="SHA256:whatTheAdminSawEarlier")
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.host_key == OLD_KEY and node.pending_host_key == NEW_KEY
    assert not AuditEvent.objects.filter(action="node.host_key.approve").exists()


def test_operator_cannot_approve_a_host_key(operator_client):
    node = pending_node()
    assert approve(operator_client, node).status_code == 403
    node.refresh_from_db()
    assert node.host_key == ""
    assert AuditEvent.objects.filter(action="permission_denied").exists()


def test_approval_needs_post(admin_client):
    node = pending_node()
    response = admin_client.get(reverse("nodes:approve_host_key", args=[node.name]))
    assert response.status_code == 405


def test_operator_probes_now_and_lands_on_the_job(operator_client, operator_user, no_broker):
    node = NodeFactory(host_key=OLD_KEY)
    response = operator_client.post(reverse("nodes:probe", args=[node.name]))
    job = Job.objects.get(node=node, kind="probe")
    assert response.status_code == 302 and response.url == job.get_absolute_url()
    assert job.created_by == operator_user and job.state == JobState.QUEUED
    assert AuditEvent.objects.get(action="node.probe").changes == {"job": job.pk}


def test_probe_now_while_a_probe_is_active_queues_nothing_more(operator_client):
    node = NodeFactory(host_key=OLD_KEY)
    Job.objects.create(kind="probe", node=node)
    response = operator_client.post(reverse("nodes:probe", args=[node.name]))
    assert response.url == node.get_absolute_url()
    assert Job.objects.filter(node=node).count() == 1


def test_probe_now_is_refused_while_a_host_key_awaits_approval(operator_client):
    node = pending_node()
    operator_client.post(reverse("nodes:probe", args=[node.name]))
    assert not Job.objects.filter(node=node).exists()


def test_viewer_cannot_probe(viewer_client):
    node = NodeFactory()
    assert viewer_client.post(reverse("nodes:probe", args=[node.name])).status_code == 403
    assert not Job.objects.exists()


def test_node_page_shows_memory_bars_per_device_and_when_it_was_last_seen(viewer_client):
    from django.utils import timezone

    node = NodeFactory(
        reachability=Reachability.REACHABLE,
        last_seen_at=timezone.now(),
        rtt_ms=0.8,
        facts={
            "os_name": "Debian GNU/Linux 12",
            "cpu_model": "AMD EPYC",
            "cpu_cores": 2,
            "rpc_port_in_use": False,
        },
    )
    DeviceFactory(node=node, name="CPU", total_bytes=16 * 1024**3, free_bytes=12 * 1024**3, bandwidth_gbs=40)
    DeviceFactory(
        node=node,
        name="CUDA0",
        kind="cuda",
        description="NVIDIA GeForce RTX 3090",
        bandwidth_override_gbs=800,
    )
    html = viewer_client.get(node.get_absolute_url()).content.decode()
    assert html.count('class="bar"') == 2
    assert 'style="width: 25%"' in html  # CPU: 4 of 16 GiB used.
    assert "12.0 GiB of 16.0 GiB" in html
    assert "NVIDIA GeForce RTX 3090" in html and "800 GB/s" in html and "(set by an admin)" in html
    assert "Last seen" in html and "round trip 0.8 ms" in html
    assert "Debian GNU/Linux 12" in html
    assert "Probe now" not in html  # Viewers cannot probe.


def test_a_changed_key_banner_shows_both_fingerprints_and_an_approve_button_to_admins(admin_client):
    node = changed_node()
    html = admin_client.get(node.get_absolute_url()).content.decode()
    assert "Host key changed." in html and NEW_FP in html and OLD_FP in html
    assert reverse("nodes:approve_host_key", args=[node.name]) in html
    assert f'name="fingerprint" value="{NEW_FP}"' in html


def test_a_viewer_sees_the_pending_key_but_no_approve_button(viewer_client):
    node = pending_node()
    viewer_html = viewer_client.get(node.get_absolute_url()).content.decode()
    assert "New host key." in viewer_html
    assert NEW_FP in viewer_html and "An admin must approve it." in viewer_html
    assert reverse("nodes:approve_host_key", args=[node.name]) not in viewer_html


def test_an_unreachable_node_is_marked_with_its_error(viewer_client):
    node = NodeFactory(
        reachability=Reachability.UNREACHABLE, last_error="10.77.3.2:22 did not answer within 10 s."
    )
    html = viewer_client.get(node.get_absolute_url()).content.decode()
    assert "Unreachable." in html and "did not answer within 10 s" in html


def test_the_hardware_partial_polls_while_a_probe_runs(operator_client):
    node = NodeFactory(host_key=OLD_KEY)
    job = Job.objects.create(kind="probe", node=node)
    url = reverse("nodes:hardware", args=[node.name])
    html = operator_client.get(url, headers={"HX-Request": "true"}).content.decode()
    assert 'hx-trigger="every 3s"' in html and job.get_absolute_url() in html
    assert "Probing…" in html
    job.finish(JobState.SUCCEEDED, result="ok")
    html = operator_client.get(url, headers={"HX-Request": "true"}).content.decode()
    assert "hx-trigger" not in html and "Probe now" in html
    assert operator_client.get(url).status_code == 302  # A full load goes to the node page.
