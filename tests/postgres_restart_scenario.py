"""The scenario of tests/deployments/test_faults_postgres.py, run by that test in a pytest of its own whose
database is a private PostgreSQL server (named by the environment) that this scenario stops and starts again.

Not collected by a plain `pytest` run (the file name does not start with `test_`): without the server
described in the environment it fails and says so.

The Celery worker is frozen (SIGSTOP) while the rpc-server step is running, so the server goes down at a
known point; thawed at once, the step's remaining work (its log lines, its end) and the claim of the next
step all meet the outage. The run is expected to wait for the database and carry on to `running`.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from django.db import connections
from django.utils import timezone

from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from jobs.models import JobState
from tests.fault_fixtures import assert_consistent, jobs_of, timed, wait_step
from tests.private_postgres import ENV, PrivatePostgres

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(1300)]

OUTAGE_S = 8


def test_the_run_waits_for_postgresql_and_carries_on(fault_lab):
    if ENV not in os.environ:
        pytest.fail(
            "Run by tests/deployments/test_faults_postgres.py, which starts the private PostgreSQL server."
        )
    server = PrivatePostgres.from_environment()
    deployment = fault_lab.ready()
    work, _control = fault_lab.start_workers()
    assert lifecycle.start_deploy(deployment, fault_lab.operator)[0]
    rpc = wait_step(deployment, "rpc-server", JobState.RUNNING)

    os.kill(work.process.pid, signal.SIGSTOP)
    try:
        rpc.refresh_from_db()
        assert rpc.state == JobState.RUNNING, "the step ended before the worker was frozen; try again"
        connections.close_all()
        down_at, down_clock = timezone.now(), time.monotonic()
        server.stop("fast")
    finally:
        os.kill(work.process.pid, signal.SIGCONT)
    time.sleep(OUTAGE_S)
    server.start()
    up_at = timezone.now()
    connections.close_all()

    deployment = fault_lab.settle(deployment)
    recovery_s = timed("PostgreSQL down between two steps -> consistent", down_clock)
    assert deployment.state == DeploymentState.RUNNING, (deployment.state, deployment.state_reason)
    states = list(jobs_of(deployment).values_list("kind", "state"))
    assert all(state == JobState.SUCCEEDED for _kind, state in states), states
    rpc.refresh_from_db()
    llama = deployment.steps.get(name="llama-server").job
    assert rpc.state == JobState.SUCCEEDED, rpc.result
    # The step boundary fell inside the outage: the rpc-server step ended, and the llama-server step
    # was claimed, only once the server was back.
    assert rpc.finished_at > down_at
    assert llama.started_at >= up_at
    assert "Database unreachable" in work.log(), "the worker never met the outage"
    assert_consistent(fault_lab, deployment)

    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk), fault_lab.operator)[0]
    deployment = fault_lab.settle(deployment)
    assert deployment.state == DeploymentState.STOPPED, deployment.state_reason
    assert_consistent(fault_lab, deployment)
    figures = {"postgres_outage_s": OUTAGE_S, "postgres_down_to_running_s": round(recovery_s, 1)}
    print("FAULTS " + json.dumps(figures))
