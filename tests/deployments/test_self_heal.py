"""Self-healing (deployments/lifecycle/healing.py) under the real runner, with the step kinds' bodies replaced
by ones that end as the test says: opt-in, one attempt at a time, backoff, a limit, and the audit of each
attempt. The real thing on the lab is in tests/deployments/test_faults_deploy.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEvent
from deployments.lifecycle import actions as lifecycle
from deployments.lifecycle import healing
from deployments.models import Deployment, DeploymentState
from jobs.context import JobFailed
from jobs.models import Job, JobState
from tests.runs import run_deployment, run_latest, run_stop

pytestmark = pytest.mark.django_db(transaction=True)


def running(deployment, *, self_heal: bool = True) -> Deployment:
    assert lifecycle.start_deploy(deployment, deployment.created_by)[0]
    assert run_deployment(deployment.pk).state == JobState.SUCCEEDED
    deployment.add_process(
        "rpc-server@old-pc", {"node": "old-pc", "role": "rpc-server", "pid": 777, "port": 50052, "log": "/l"}
    )
    deployment.record(self_heal=self_heal)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING
    assert deployment.mark_degraded("rpc-server on old-pc (PID 777) is not running.")
    return deployment


def heal(deployment) -> Job:
    run = healing.consider(Deployment.objects.get(pk=deployment.pk))
    assert run is not None
    assert run_latest(deployment.pk, lifecycle.HEAL).pk == run.pk
    run.refresh_from_db()
    deployment.refresh_from_db()
    return run


def test_a_degraded_deployment_that_opted_in_is_restarted_and_runs_again(deployment, no_enqueue, steps):
    ran = steps(lambda job: "ok")
    deployment = running(deployment)
    ran.clear()
    run = heal(deployment)
    assert run.state == JobState.SUCCEEDED
    assert deployment.state == DeploymentState.RUNNING and deployment.heal_attempts == 0
    assert [job.kind for job in ran] == [
        "stop",
        "reap",
        "reap",
        "rpc_server",
        "rpc_tunnel",
        "preflight",
        "llama_server",
        "verify",
        "measure",
    ]
    assert ("heal", deployment.pk) in no_enqueue
    actions = list(AuditEvent.objects.filter(object_id=str(deployment.pk)).values_list("action", flat=True))
    assert {"deployment.heal_started", "deployment.healed"} <= set(actions)
    assert deployment.claims.exists()
    # The console healed it, not the person who deployed it: no one pressed a button.
    assert run.created_by is None and not run.children.exclude(created_by=None).exists()
    system = AuditEvent.objects.filter(
        object_id=str(deployment.pk),
        action__in=["deployment.heal_started", "deployment.healed", "deployment.running"],
    )
    assert {(e.actor_id, e.actor_name) for e in system} <= {(None, "self-heal"), (None, "console")}
    assert deployment.created_by.get_username() not in {e.actor_name for e in system}


def test_without_opting_in_nothing_is_attempted(deployment, no_enqueue, steps):
    steps(lambda job: "ok")
    deployment = running(deployment, self_heal=False)
    assert healing.consider(deployment) is None
    assert not lifecycle.runs_of(deployment, lifecycle.HEAL).exists()


def test_failed_attempts_back_off_and_the_last_one_fails_the_deployment(
    deployment, no_enqueue, steps, settings
):
    settings.RAMDECK_SELF_HEAL_ATTEMPTS = 2
    settings.RAMDECK_SELF_HEAL_BACKOFF_S = 60
    healthy = True

    def outcome(job):
        if job.kind == "rpc_server" and not healthy:
            raise JobFailed("PID 4242 exited before listening on port 50052")
        return "ok"

    steps(outcome)
    deployment = running(deployment)
    healthy = False

    assert heal(deployment).state == JobState.FAILED
    assert deployment.state == DeploymentState.DEGRADED
    assert "Self-healing attempt 1 of 2 failed at rpc-server" in deployment.state_reason
    assert healing.consider(deployment) is None  # backing off
    Deployment.objects.filter(pk=deployment.pk).update(last_heal_at=timezone.now() - timedelta(seconds=61))

    assert heal(deployment).state == JobState.FAILED
    assert deployment.state == DeploymentState.FAILED and deployment.failed_step == "rpc-server"
    assert "gave up after 2 attempts" in deployment.state_reason
    assert not deployment.claims.exists()
    assert AuditEvent.objects.filter(action="deployment.heal_failed").count() == 1
    assert AuditEvent.objects.filter(action="deployment.heal_started").count() == 2


def test_stop_during_a_heal_cancels_it_and_stops(deployment, no_enqueue, steps):
    steps(lambda job: "ok")
    deployment = running(deployment)
    run = healing.consider(deployment)
    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk))[0]
    assert Job.objects.get(pk=run.pk).state == JobState.CANCELLED  # it had not started
    assert run_stop(deployment.pk).state == JobState.SUCCEEDED
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED and not deployment.claims.exists()


def test_an_operator_turns_self_healing_on_and_it_is_audited(operator_client, deployment):
    url = reverse("deployments:self_heal", args=[deployment.pk])
    operator_client.post(url, {"on": "1"})
    deployment.refresh_from_db()
    assert deployment.self_heal
    assert AuditEvent.objects.get(action="deployment.self_heal").changes == {"on": True}
