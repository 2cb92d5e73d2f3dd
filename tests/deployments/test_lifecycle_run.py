"""A deployment's runs (deployments/lifecycle/runs.py) under the real runner, with each step kind's body
replaced by one that ends as the test says: the ordering, rollback, stop, worker loss and time limit,
supervised once by jobs/runner.py for the run and its steps alike. The real step bodies over SSH with real
llama.cpp are tests/deployments/test_e2e_deployment.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from jobs import runner, sweeper
from jobs.context import JobFailed
from jobs.models import Job, JobState
from tests.job_fixtures import wait_for
from tests.runs import run_deployment, run_stop

pytestmark = pytest.mark.django_db(transaction=True)


def fail_when(kind: str, reason: str = "boom"):
    def outcome(job):
        if job.kind == kind:
            raise JobFailed(reason)
        return "ok"

    return outcome


def _started(deployment) -> Job:
    ok, message = lifecycle.start_deploy(deployment, deployment.created_by)
    assert ok, message
    deployment.add_process(
        "rpc-server@old-pc", {"node": "old-pc", "role": "rpc-server", "pid": 777, "port": 50052, "log": "/l"}
    )
    return lifecycle.runs_of(deployment, lifecycle.DEPLOY).get()


def test_the_steps_run_in_order_as_children_of_the_run(deployment, no_enqueue, steps):
    ran = steps(lambda job: "ok")
    run = _started(deployment)
    assert run_deployment(deployment.pk).state == JobState.SUCCEEDED
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING
    assert [job.kind for job in ran] == [
        "reap",
        "reap",
        "rpc_server",
        "rpc_tunnel",
        "preflight",
        "llama_server",
        "verify",
        "measure",
    ]
    children = Job.objects.filter(parent=run)
    assert {job.worker for job in children} == {Job.objects.get(pk=run.pk).worker}
    assert set(children.values_list("state", flat=True)) == {JobState.SUCCEEDED}
    assert AuditEvent.objects.filter(action="deployment.running").exists()


def test_a_rollback_that_fails_is_named_in_the_failure_reason(deployment, no_enqueue, steps):
    def outcome(job):
        if job.kind == "stop":
            raise JobFailed("rpc-server PID 777 on old-pc did not end")
        if job.kind == "rpc_server":
            raise JobFailed("boom")
        return "ok"

    steps(outcome)
    _started(deployment)
    assert run_deployment(deployment.pk).state == JobState.FAILED
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED and deployment.failed_step == "rpc-server"
    assert "boom" in deployment.state_reason
    assert "Rollback incomplete, stop needed" in deployment.state_reason
    assert "PID 777 on old-pc did not end" in deployment.state_reason
    event = AuditEvent.objects.get(action="deployment.failed")
    assert event.changes["rollback_failures"]


def test_a_clean_rollback_says_nothing_more_and_the_later_steps_are_skipped(deployment, no_enqueue, steps):
    ran = steps(fail_when("rpc_server"))
    _started(deployment)
    run_deployment(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED and "Rollback" not in deployment.state_reason
    assert not Deployment.objects.get(pk=deployment.pk).claims.exists()
    assert [job.kind for job in ran][-1] == "stop"  # the rollback
    later = deployment.steps.filter(name__in=["llama-server", "verify", "measure"])
    assert set(later.values_list("job__state", flat=True)) == {JobState.CANCELLED}


def _left_running(deployment, run: Job, *, beat_age_s: float) -> Job:
    """The reap steps succeeded, then the worker running the rpc-server step died (or still beats)."""
    run.mark_running(worker="celery@w1")
    for step in deployment.steps.filter(name="reap").select_related("job"):
        step.job.mark_running(worker="celery@w1")
        step.job.finish(JobState.SUCCEEDED, result="free")
    deployment.mark_launching()
    job = deployment.steps.get(name="rpc-server").job
    job.mark_running(worker="celery@w1")
    stale = timezone.now() - timedelta(seconds=beat_age_s)
    Job.objects.filter(pk__in=[run.pk, job.pk]).update(heartbeat_at=stale)
    return job


def test_a_run_whose_worker_died_is_rolled_back_and_fails_with_its_step(deployment, no_enqueue, steps):
    ran = steps(lambda job: "ok")
    run = _started(deployment)
    step = _left_running(deployment, run, beat_age_s=3600)

    assert sweeper.sweep(alive=set()) == [run.pk]

    run.refresh_from_db()
    step.refresh_from_db()
    assert run.state == JobState.ERRORED and "Worker lost" in run.result
    assert step.state == JobState.ERRORED
    assert ("undeploy", deployment.pk) in no_enqueue  # the rollback, queued by the deploy kind's on_end
    assert run_stop(deployment.pk).state == JobState.SUCCEEDED
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED and deployment.failed_step == "rpc-server"
    assert "Worker lost" in deployment.state_reason
    assert [job.kind for job in ran] == ["stop"]  # the rollback, and no later step
    assert not deployment.claims.exists()
    assert AuditEvent.objects.filter(action="deployment.failed").exists()


def test_a_run_still_beating_is_left_to_its_worker(deployment, no_enqueue, steps):
    steps(lambda job: "ok")
    run = _started(deployment)
    _left_running(deployment, run, beat_age_s=1)
    assert sweeper.sweep(alive=set()) == []
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.LAUNCHING
    assert not runner.run_job(run.pk)  # a second delivery of its message does nothing


def test_stop_after_the_run_died_declares_it_lost_and_stops(deployment, no_enqueue, steps):
    ran = steps(lambda job: "ok")
    run = _started(deployment)
    _left_running(deployment, run, beat_age_s=3600)
    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk))[0]
    assert run_stop(deployment.pk).state == JobState.SUCCEEDED
    deployment.refresh_from_db()
    run.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED
    assert run.state == JobState.ERRORED and "Worker lost" in run.result
    assert [job.kind for job in ran] == ["stop"]
    assert not deployment.steps.filter(job__state__in=[JobState.QUEUED, JobState.RUNNING]).exists()
    assert not deployment.claims.exists()


def test_stop_during_a_step_cancels_the_run_and_the_stop_run_finishes_it(deployment, no_enqueue, steps):
    ran = steps(lambda job: "wait" if job.kind == "rpc_server" else "ok")
    run = _started(deployment)
    thread = threading.Thread(target=runner.run_job, args=(run.pk,), daemon=True)
    thread.start()
    rpc = deployment.steps.get(name="rpc-server").job
    wait_for(lambda: Job.objects.get(pk=rpc.pk).state == JobState.RUNNING, what="the rpc-server step")

    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk))[0]
    # Pressed again while the stop waits for a worker: sent again (harmless), never a second stop run.
    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk)) == (
        True,
        "Stopping: the stop was sent to a worker again.",
    )
    assert lifecycle.runs_of(deployment, lifecycle.UNDEPLOY).count() == 1
    assert run_stop(deployment.pk).state == JobState.SUCCEEDED
    thread.join(timeout=30)

    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED
    assert Job.objects.get(pk=run.pk).state == JobState.CANCELLED
    assert Job.objects.get(pk=rpc.pk).state == JobState.CANCELLED
    later = deployment.steps.filter(name__in=["llama-server", "verify", "measure"])
    assert set(later.values_list("job__state", flat=True)) == {JobState.CANCELLED}
    assert [job.kind for job in ran] == ["reap", "reap", "rpc_server", "stop"]
    assert not deployment.claims.exists()


def test_a_run_past_its_time_limit_is_stopped_rolled_back_and_failed(deployment, no_enqueue, steps, job_kind):
    from jobs import kinds

    deploy = kinds.get("deploy")
    job_kind("deploy", deploy.body, needs_transport=False, on_end=deploy.on_end, time_limit=2)
    steps(lambda job: "wait" if job.kind == "llama_server" else "ok")
    run = _started(deployment)
    assert run_deployment(deployment.pk).state == JobState.ERRORED
    run.refresh_from_db()
    assert "time limit" in run.result
    assert run_stop(deployment.pk).state == JobState.SUCCEEDED  # the rollback it queued
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED and deployment.failed_step == "llama-server"
    assert "time limit" in deployment.state_reason
    assert deployment.steps.filter(name="rollback", job__state=JobState.SUCCEEDED).exists()
    assert not deployment.steps.filter(job__state__in=[JobState.QUEUED, JobState.RUNNING]).exists()
    assert not deployment.claims.exists()


def test_a_lost_stop_run_is_started_again(deployment, no_enqueue, steps):
    steps(lambda job: "ok")
    _started(deployment)
    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk))[0]
    first = lifecycle.active_run(deployment, lifecycle.UNDEPLOY)
    first.mark_running(worker="celery@gone")
    Job.objects.filter(pk=first.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert sweeper.sweep(alive=set()) == [first.pk]
    second = lifecycle.active_run(deployment, lifecycle.UNDEPLOY)
    assert second is not None and second.pk != first.pk
    assert run_stop(deployment.pk).state == JobState.SUCCEEDED
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED and not deployment.claims.exists()
