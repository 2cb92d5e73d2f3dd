"""A deploy and a calibration of one of its nodes cannot both pass their checks in the same instant: each
checks the other under the nodes' row locks (deployments/lifecycle/actions.py `start_deploy`,
calibration/store.py `locked_refusal`), so whichever comes second waits for the first to commit and sees
what it did."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import close_old_connections, connection

from deployments.lifecycle import actions
from deployments.models import Deployment, DeploymentState, ResourceClaim
from jobs.models import Job, JobState
from modelfiles.models import ModelFile
from tests.deployments.test_deployment_states import _build, _ready
from tests.factories import DeviceFactory, NodeFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

PAUSE_S = 1.5


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setattr(Job, "send_to_worker", lambda job: True)
    coordinator = NodeFactory(name="desk", may_coordinate=True)
    worker = NodeFactory(name="old-pc")
    DeviceFactory(node=worker, name="CPU")
    model = ModelFile.objects.create(name="tiny", node=coordinator, path="/m/tiny.gguf")
    _build(coordinator)
    _build(worker)
    return coordinator, worker, model


def _in_thread(target, results: dict, key: str) -> threading.Thread:
    def body() -> None:
        try:
            results[key] = target()
        finally:
            connection.close()

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def test_a_calibration_that_starts_while_a_deploy_holds_the_lock_waits_and_is_refused(cluster, monkeypatch):
    from calibration.store import locked_refusal

    _, worker, _ = cluster
    deployment = _ready(cluster)
    locked = threading.Event()
    checked = actions.calibration_refusal_of

    calls: list[str] = []

    def slow_check(nodes):
        # Its second check is the one under the nodes' locks: the calibration below starts in this instant.
        answer = checked(nodes)
        calls.append(answer)
        if threading.current_thread() is not threading.main_thread() and len(calls) == 2:
            locked.set()
            time.sleep(PAUSE_S)
        return answer

    monkeypatch.setattr(actions, "calibration_refusal_of", slow_check)
    calibration = Job.objects.create(kind="calibrate", node=worker, title="Calibrate old-pc")
    results: dict = {}
    deploy = _in_thread(
        lambda: actions.start_deploy(Deployment.objects.get(pk=deployment.pk)), results, "deploy"
    )
    assert locked.wait(20)
    # The calibration job starts running (the runner marks it so) and checks the node before it does
    # anything. (On SQLite the update itself waits for the deploy's write transaction; on PostgreSQL the
    # check waits for the nodes' row locks.)
    asked = time.monotonic()
    Job.objects.filter(pk=calibration.pk).update(state=JobState.RUNNING)
    reason = locked_refusal(worker)
    answered = time.monotonic()
    deploy.join(30)
    close_old_connections()

    assert results["deploy"][0] is True, results
    assert reason.startswith("old-pc serves deployment tiny"), reason
    assert answered - asked >= PAUSE_S * 0.5  # it waited for the deploy's transaction to end


def test_a_deploy_whose_node_started_calibrating_after_its_first_check_is_refused_under_the_lock(
    cluster, monkeypatch
):
    """The deploy's first check (no lock) saw no calibration; one started before the deploy took the
    nodes' locks: the check under the lock sees it and nothing is claimed."""
    _, worker, _ = cluster
    deployment = _ready(cluster)
    calibration = Job.objects.create(kind="calibrate", node=worker, title="Calibrate old-pc")
    lock = actions.lock_nodes

    def calibration_starts_first(nodes):
        Job.objects.filter(pk=calibration.pk).update(state=JobState.RUNNING)
        return lock(nodes)

    monkeypatch.setattr(actions, "lock_nodes", calibration_starts_first)
    started, reason = actions.start_deploy(deployment)

    assert not started
    assert reason == "old-pc is being calibrated (Calibrate old-pc): deploy once that job ends."
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.CONFIRMED
    assert not ResourceClaim.objects.filter(deployment=deployment).exists()
