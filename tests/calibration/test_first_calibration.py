"""A node is calibrated by itself after its first recorded build: the build job's success queues the
calibration of a node that has none (and only then), as the build's own creator, audited."""

from __future__ import annotations

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from builds import job as build_job
from builds.models import Build
from calibration.store import calibrate_after_first_build
from jobs.models import Job, JobState
from nodes.models import DeviceKind, Node
from tests.deploy_fixtures import lab_node, log_text, record_enqueued, rpc_server_binary, run
from tests.factories import DeviceFactory, NodeFactory, UserFactory


def a_build(node: Node, user=None) -> Build:
    job = Job.objects.create(kind="build", node=node, created_by=user, state=JobState.SUCCEEDED)
    return Build.objects.create(
        node=node, source_kind="existing", rpc_server_path="/r", llama_server_path="/l", job_id=job.pk
    )


def test_the_calibration_app_registers_its_hook_with_the_build_job():
    assert calibrate_after_first_build in build_job.AFTER_RECORDED
    build_job.after_recorded(calibrate_after_first_build)  # registering twice keeps one
    assert build_job.AFTER_RECORDED.count(calibrate_after_first_build) == 1


@pytest.mark.django_db
def test_a_first_build_queues_the_nodes_calibration_as_its_creator_with_an_audit_entry(
    monkeypatch, django_capture_on_commit_callbacks
):
    sent = record_enqueued(monkeypatch)
    operator = UserFactory(username="olga", role="operator")
    node = NodeFactory(name="attic-pc")
    DeviceFactory(node=node, name="CPU", kind=DeviceKind.CPU)
    build = a_build(node, operator)
    with django_capture_on_commit_callbacks(execute=True):
        said = calibrate_after_first_build(build)
    assert sent == [("calibrate", None)]  # sent to a worker once its transaction committed
    job = Job.objects.get(kind="calibrate", node=node)
    assert said == f"attic-pc has never been calibrated: calibrating it now (job {job.pk})."
    assert job.created_by == operator and job.state == JobState.QUEUED
    event = AuditEvent.objects.get(action="node.calibrate")
    assert event.actor == operator and event.changes == {"job": job.pk, "after_build": build.pk}
    # A second build while it is queued starts no second one.
    assert calibrate_after_first_build(a_build(node, operator)) == ""
    assert Job.objects.filter(kind="calibrate").count() == 1


@pytest.mark.django_db
def test_a_node_that_has_its_figures_is_not_calibrated_again_by_a_build():
    node = NodeFactory(name="desk", calibrated_at=timezone.now())
    DeviceFactory(node=node, name="CPU", kind=DeviceKind.CPU)
    assert calibrate_after_first_build(a_build(node)) == ""
    assert not Job.objects.filter(kind="calibrate").exists()


@pytest.mark.django_db
def test_a_node_that_cannot_be_calibrated_yet_says_why_in_the_build_log():
    node = NodeFactory(name="desk")  # never probed: no devices
    said = calibrate_after_first_build(a_build(node))
    assert said == (
        "desk has never been calibrated, and cannot be now: desk has no devices on record: probe it first."
    )
    assert not Job.objects.filter(kind="calibrate").exists()


@pytest.mark.lab
@pytest.mark.llamacpp
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_registering_an_existing_install_queues_the_first_calibration_from_the_build_job(
    lab, lab_host, monkeypatch
):
    """The real build job ("Existing install") on a lab host over SSH: its success queues the calibration,
    says so in its log, and a second build of the now calibrated node queues none."""
    sent = record_enqueued(monkeypatch)
    operator = UserFactory(username="olga", role="operator")
    node = lab_node(lab, lab_host)
    DeviceFactory(node=node, name="CPU", kind=DeviceKind.CPU)
    params = {"source": "existing", "path": str(rpc_server_binary().parent)}
    job = run(Job.objects.create(kind="build", node=node, params=params, created_by=operator))
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job))
    calibration = Job.objects.get(kind="calibrate", node=node)
    assert calibration.state == JobState.QUEUED and calibration.created_by == operator
    assert f"calibrating it now (job {calibration.pk})" in log_text(job)
    assert ("calibrate", None) in sent
    # Once it has figures, a later build leaves them alone.
    Node.objects.filter(pk=node.pk).update(calibrated_at=timezone.now())
    Job.objects.filter(pk=calibration.pk).update(state=JobState.SUCCEEDED)
    again = run(Job.objects.create(kind="build", node=node, params=params, created_by=operator))
    assert again.state == JobState.SUCCEEDED, again.result
    assert Job.objects.filter(kind="calibrate", node=node).count() == 1
    assert "calibrat" not in log_text(again)
