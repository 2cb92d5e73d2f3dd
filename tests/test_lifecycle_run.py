"""deployments/lifecycle.py's run of the steps, with the job runner replaced by a function that ends each
job as the test says (a unit test of the ordering and of the failure paths; the real runner over SSH with
real llama.cpp is tests/test_e2e_deployment.py)."""

from __future__ import annotations

import pytest

from deployments import lifecycle
from deployments.models import Deployment, DeploymentState
from jobs.models import AuditEvent, Job, JobState
from tests.test_lifecycle_views import deployment, no_enqueue  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db


def _fake_runner(monkeypatch, outcome):
    """Replace lifecycle._run: `outcome(job)` gives (state, result) for each job it "runs"."""
    ran = []

    def run(job: Job) -> Job:
        state, result = outcome(job)
        job.mark_running(worker="celery@test")
        job.finish(state, result=result)
        job.refresh_from_db()
        ran.append(job)
        return job

    monkeypatch.setattr(lifecycle, "_run", run)
    return ran


def _started(deployment, no_enqueue):  # noqa: F811
    ok, message = lifecycle.start_deploy(deployment, deployment.created_by)
    assert ok, message
    deployment.add_process(
        "rpc-server@old-pc", {"node": "old-pc", "role": "rpc-server", "pid": 777, "port": 50052, "log": "/l"}
    )


def test_a_rollback_that_fails_is_named_in_the_failure_reason(deployment, no_enqueue, monkeypatch):  # noqa: F811
    _started(deployment, no_enqueue)

    def outcome(job):
        if job.kind == "stop":
            return JobState.FAILED, "rpc-server PID 777 on old-pc did not end"
        if job.params.get("step") == "rpc-server":
            return JobState.FAILED, "boom"
        return JobState.SUCCEEDED, "ok"

    _fake_runner(monkeypatch, outcome)
    lifecycle.run_deployment(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED and deployment.failed_step == "rpc-server"
    assert "boom" in deployment.state_reason
    assert "Rollback incomplete, stop needed" in deployment.state_reason
    assert "PID 777 on old-pc did not end" in deployment.state_reason
    event = AuditEvent.objects.get(action="deployment.failed")
    assert event.changes["rollback_failures"]


def test_a_clean_rollback_says_nothing_more(deployment, no_enqueue, monkeypatch):  # noqa: F811
    _started(deployment, no_enqueue)
    _fake_runner(
        monkeypatch,
        lambda job: (
            (JobState.FAILED, "boom")
            if job.params.get("step") == "rpc-server"
            else (JobState.SUCCEEDED, "ok")
        ),
    )
    lifecycle.run_deployment(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED and "Rollback" not in deployment.state_reason
    assert not Deployment.objects.get(pk=deployment.pk).claims.exists()
