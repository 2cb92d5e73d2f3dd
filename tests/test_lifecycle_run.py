"""deployments/lifecycle.py's run of the steps, with the job runner replaced by a function that ends each
job as the test says (a unit test of the ordering and of the failure paths; the real runner over SSH with
real llama.cpp is tests/test_e2e_deployment.py)."""

# ruff: noqa: F811 - pytest fixtures imported from tests/test_lifecycle_views.py are parameters here
from __future__ import annotations

from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.utils import timezone

from deployments import lifecycle, tasks
from deployments.models import Deployment, DeploymentState
from jobs.models import AuditEvent, Job, JobState
from tests.test_lifecycle_views import deployment, no_enqueue  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db


def _fake_runner(monkeypatch, outcome):
    """Replace lifecycle._run: `outcome(job)` gives (state, result) for each job it "runs"."""
    ran = []

    def run(job: Job, worker: str = "") -> Job:
        state, result = outcome(job)
        job.mark_running(worker=worker)
        job.finish(state, result=result)
        job.refresh_from_db()
        ran.append(job)
        return job

    monkeypatch.setattr(lifecycle, "_run", run)
    return ran


def _started(deployment, no_enqueue):
    ok, message = lifecycle.start_deploy(deployment, deployment.created_by)
    assert ok, message
    deployment.add_process(
        "rpc-server@old-pc", {"node": "old-pc", "role": "rpc-server", "pid": 777, "port": 50052, "log": "/l"}
    )


def test_a_rollback_that_fails_is_named_in_the_failure_reason(deployment, no_enqueue, monkeypatch):
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


def test_a_clean_rollback_says_nothing_more(deployment, no_enqueue, monkeypatch):
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


def _all_succeed(job):
    return JobState.SUCCEEDED, "ok"


def test_the_steps_run_under_the_celery_workers_name(deployment, no_enqueue, monkeypatch):
    import socket

    from jobs import runner

    _started(deployment, no_enqueue)
    workers = []

    def run_job(job_id, *, worker=""):
        workers.append(worker)
        job = Job.objects.get(pk=job_id)
        job.mark_running(worker=worker)
        job.finish(JobState.SUCCEEDED, result="ok")

    monkeypatch.setattr(runner, "run_job", run_job)
    tasks.deploy.apply(args=[deployment.pk])  # eager: request.hostname is this host's name
    assert workers and set(workers) == {socket.gethostname()}
    assert Job.objects.filter(worker=socket.gethostname()).count() == len(workers)


def _left_running(deployment, *, beat_age_s: float) -> Job:
    """The reap steps succeeded, then the worker running the rpc-server step died (or still beats)."""
    for step in deployment.steps.filter(name="reap").select_related("job"):
        step.job.mark_running(worker="celery@w1")
        step.job.finish(JobState.SUCCEEDED, result="free")
    deployment.mark_launching()
    job = deployment.steps.get(name="rpc-server").job
    job.mark_running(worker="celery@w1")
    Job.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=beat_age_s))
    return job


def test_a_redelivered_run_finding_a_step_with_a_stale_heartbeat_rolls_back_and_fails(
    deployment,
    no_enqueue,
    monkeypatch,
):
    _started(deployment, no_enqueue)
    job = _left_running(deployment, beat_age_s=3600)
    ran = _fake_runner(monkeypatch, _all_succeed)
    lifecycle.run_deployment(deployment.pk, "celery@w2")
    deployment.refresh_from_db()
    job.refresh_from_db()
    assert job.state == JobState.ERRORED and "Worker lost" in job.result
    assert deployment.state == DeploymentState.FAILED and deployment.failed_step == "rpc-server"
    assert [j.kind for j in ran] == ["stop"]  # the rollback, and no later step
    assert not deployment.claims.exists()


def test_a_step_still_beating_is_left_to_its_run(deployment, no_enqueue, monkeypatch):
    _started(deployment, no_enqueue)
    _left_running(deployment, beat_age_s=1)
    ran = _fake_runner(monkeypatch, _all_succeed)
    lifecycle.run_deployment(deployment.pk, "celery@w2")
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.LAUNCHING and ran == []


def test_stop_after_the_run_died_is_done_by_a_stop_task(
    deployment,
    no_enqueue,
    monkeypatch,
    django_capture_on_commit_callbacks,
):
    _started(deployment, no_enqueue)
    _left_running(deployment, beat_age_s=3600)
    with django_capture_on_commit_callbacks(execute=True):
        assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk))[0]
    assert ("stop", deployment.pk) in no_enqueue
    ran = _fake_runner(monkeypatch, _all_succeed)
    lifecycle.run_stop(deployment.pk, "celery@w2")
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED
    assert [j.kind for j in ran] == ["stop"]
    assert not deployment.steps.filter(job__state=JobState.QUEUED).exists()


def test_stop_while_a_step_beats_is_left_to_the_run(
    deployment,
    no_enqueue,
    django_capture_on_commit_callbacks,
):
    _started(deployment, no_enqueue)
    _left_running(deployment, beat_age_s=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk))[0]
    assert ("stop", deployment.pk) not in no_enqueue


def test_a_deploy_past_the_soft_time_limit_rolls_back_and_fails(deployment, no_enqueue, monkeypatch):
    _started(deployment, no_enqueue)

    def outcome(job):
        if job.params.get("step") == "llama-server":
            raise SoftTimeLimitExceeded()
        return JobState.SUCCEEDED, "ok"

    ran = _fake_runner(monkeypatch, outcome)
    tasks.deploy.apply(args=[deployment.pk])
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED and "time limit" in deployment.state_reason
    assert ran[-1].kind == "stop"  # rolled back
    assert not deployment.steps.filter(job__state__in=[JobState.QUEUED, JobState.RUNNING]).exists()
