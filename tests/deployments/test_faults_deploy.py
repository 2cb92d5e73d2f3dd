"""Faults injected into deployments on the lab, with real processes all the way (real sshd, real llama.cpp,
real Celery workers, real Redis), each ending in a known state checked by `assert_consistent`.

Times are printed (run with -s); the worker-crash recovery time is reported, not asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
from django.db import connections
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent
from deployments import monitor
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from jobs.models import JobState
from tests.deploy_fixtures import lab_devices, pid_alive
from tests.factories import UserFactory
from tests.fault_fixtures import assert_consistent, jobs_of, our_processes, timed, wait_step
from tests.job_fixtures import wait_for
from tests.runs import run_latest

pytestmark = [
    pytest.mark.faults,
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.timeout(1200),
    pytest.mark.django_db(transaction=True),
]


def test_the_worker_sigkilled_during_a_launch_ends_in_a_clean_failure(fault_lab, figure):
    deployment = fault_lab.ready()
    work = fault_lab.start_worker(consume=("work",))
    fault_lab.start_worker(consume=("control",))  # lives on, like make run's control worker
    assert lifecycle.start_deploy(deployment, fault_lab.operator)[0]
    llama = wait_step(deployment, "llama-server", JobState.RUNNING)
    wait_for(lambda: "llama-server@desk" in Deployment.objects.get(pk=deployment.pk).processes, what="llama")

    killed_at = time.monotonic()
    work.kill()  # SIGKILL, mid-launch: llama-server is loading, its step is running.
    deployment = fault_lab.settle(deployment)
    recovery_s = timed("worker SIGKILL during launch -> consistent", killed_at)

    assert deployment.state == DeploymentState.FAILED
    assert deployment.failed_step == "llama-server"
    assert "Worker lost" in deployment.state_reason
    llama.refresh_from_db()
    assert llama.state == JobState.ERRORED and "Worker lost" in llama.result
    assert deployment.steps.filter(name="rollback", job__state=JobState.SUCCEEDED).count() == 2
    assert_consistent(fault_lab, deployment)
    print("FAULTS " + json.dumps({"worker_sigkill_to_consistent_s": round(recovery_s, 1)}))
    figure("worker_sigkill_to_consistent_s", round(recovery_s, 1))


def test_a_killed_llama_server_makes_the_deployment_degraded_with_its_last_log_lines(fault_lab, monkeypatch):
    deployment = fault_lab.deploy(fault_lab.ready(), monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, deployment.state_reason
    llama = deployment.processes["llama-server@desk"]
    os.kill(int(llama["pid"]), signal.SIGKILL)
    wait_for(lambda: not pid_alive(int(llama["pid"])), what="llama-server to die")
    assert monitor.check_all() == [deployment.pk]
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.DEGRADED
    assert f"llama-server on desk (PID {llama['pid']}) is not running" in deployment.state_reason
    assert "Last log lines:" in deployment.state_reason and "llama" in deployment.state_reason
    assert AuditEvent.objects.filter(action="deployment.degraded", object_id=str(deployment.pk)).exists()
    assert_consistent(fault_lab, deployment)  # degraded: claims held, the rpc-server accounted for
    deployment = fault_lab.stop(deployment, monkeypatch)
    assert deployment.state == DeploymentState.STOPPED
    assert_consistent(fault_lab, deployment)


def test_an_rpc_server_that_exits_at_once_on_a_bad_flag_fails_the_launch_naming_it(fault_lab, monkeypatch):
    deployment = fault_lab.ready()
    worker = fault_lab.workers[0]
    # ggml-rpc-server prints its usage for an unknown option and exits with status 0.
    deployment.plan["rpc_servers"] = [{"node": worker.name, "args": ["-p", "50052", "--no-such-flag"]}]
    deployment.save(update_fields=["plan"])
    deployment = fault_lab.deploy(deployment, monkeypatch)
    assert deployment.state == DeploymentState.FAILED
    assert deployment.failed_step == "rpc-server"
    assert "exited before listening on port 50052" in deployment.state_reason
    assert "Last log lines" in deployment.state_reason
    assert_consistent(fault_lab, deployment)


def test_two_operators_deploying_to_the_same_node_at_the_same_instant_one_wins(fault_lab, monkeypatch):
    first = fault_lab.ready()
    second = Deployment.objects.create(
        name="tiny-2", model_file=first.model_file, coordinator=first.coordinator, plan=first.plan, port=8080
    )
    fault_lab.start_workers()
    operators = [UserFactory(username=f"op-{i}", role="operator") for i in (1, 2)]
    gate = threading.Barrier(2)
    answers: dict[int, str] = {}

    def press(user, deployment):
        try:
            client = client_for(user)
            gate.wait()
            response = client.post(reverse("deployments:deploy", args=[deployment.pk]), follow=True)
            answers[deployment.pk] = response.content.decode()
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=press, args=pair) for pair in zip(operators, (first, second), strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    states = {d.pk: Deployment.objects.get(pk=d.pk).state for d in (first, second)}
    winners = [pk for pk, state in states.items() if state != DeploymentState.CONFIRMED]
    assert len(winners) == 1, states
    loser = second if winners == [first.pk] else first
    winner = first if loser is second else second
    assert "is held by deployment" in answers[loser.pk]
    assert not jobs_of(loser).exists()
    assert AuditEvent.objects.filter(action="deployment.refused", object_id=str(loser.pk)).exists()
    winner = fault_lab.wait_state(winner, [DeploymentState.RUNNING, DeploymentState.FAILED])
    assert winner.state == DeploymentState.RUNNING, winner.state_reason
    assert lifecycle.stop_deployment(winner, operators[0])[0]
    winner = fault_lab.settle(winner)
    assert_consistent(fault_lab, winner, loser)


def test_the_same_confirm_posted_twice_makes_one_deployment(fault_lab, operator_user):
    fault_lab.build_all()
    model = fault_lab.model()
    lab_devices(fault_lab.coordinator, fault_lab.workers)
    preview = client_for(operator_user).get(reverse("deployments:plan", args=[model.pk]), {"ctx": 512})
    token = preview.context["confirm_token"]
    form = {
        "ctx": 512,
        "parallel": 1,
        "cache_type": "f16",
        "clamp": 0.7,
        "name": "twice",
        "confirm_token": token,
    }
    form["nodes"] = [n.pk for n in fault_lab.nodes]
    form["coordinator"] = fault_lab.coordinator.pk
    gate = threading.Barrier(2)
    codes = []

    def post():
        try:
            client = client_for(operator_user)
            gate.wait()
            codes.append(client.post(reverse("deployments:confirm", args=[model.pk]), form).status_code)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=post) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    again = client_for(operator_user).post(reverse("deployments:confirm", args=[model.pk]), form)
    assert codes == [302, 302] and again.status_code == 302
    assert Deployment.objects.filter(name="twice").count() == 1
    assert AuditEvent.objects.filter(action="deployment.confirm").count() == 1
    assert_consistent(fault_lab, Deployment.objects.get(name="twice"))


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# -- Stop pressed in every state ------------------------------------------------------------------------


def _stop(fault_lab, deployment: Deployment) -> Deployment:
    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk), fault_lab.operator)[0]
    return fault_lab.settle(deployment)


def test_stop_in_confirmed_stopped_and_failed_is_refused_and_changes_nothing(fault_lab, monkeypatch):
    deployment = fault_lab.ready()
    assert lifecycle.stop_deployment(deployment, fault_lab.operator)[0] is False
    assert not jobs_of(deployment).exists()
    deployment = fault_lab.deploy(deployment, monkeypatch)
    deployment = fault_lab.stop(deployment, monkeypatch)
    assert deployment.state == DeploymentState.STOPPED
    assert lifecycle.stop_deployment(deployment, fault_lab.operator)[0] is False
    plan = {
        **deployment.plan,
        "rpc_servers": [{"node": fault_lab.workers[0].name, "args": ["--no-such-flag"]}],
    }
    failed = Deployment.objects.create(
        name="bad-flag", model_file=deployment.model_file, coordinator=deployment.coordinator, plan=plan
    )
    failed = fault_lab.deploy(failed, monkeypatch)
    assert failed.state == DeploymentState.FAILED
    assert lifecycle.stop_deployment(failed, fault_lab.operator)[0] is False
    assert_consistent(fault_lab, deployment, failed)


def test_stop_while_preparing_with_the_run_message_lost(fault_lab):
    """The deploy run's message is lost (no worker has taken it): Stop cancels it and still stops."""
    import redis
    from django.conf import settings

    deployment = fault_lab.ready()
    control = fault_lab.start_worker(consume=("control",))  # no work worker: the run is not taken
    assert lifecycle.start_deploy(deployment, fault_lab.operator)[0]
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(control.queue)  # and Redis lost its message
    deployment = _stop(fault_lab, deployment)
    assert deployment.state == DeploymentState.STOPPED
    assert lifecycle.runs_of(deployment, lifecycle.DEPLOY).get().state == JobState.CANCELLED
    assert_consistent(fault_lab, deployment)


@pytest.mark.parametrize("moment", ["launching", "verifying", "running", "degraded"])
def test_stop_pressed_while_the_deployment_is(fault_lab, moment):
    deployment = fault_lab.ready()
    fault_lab.start_workers()
    assert lifecycle.start_deploy(deployment, fault_lab.operator)[0]
    if moment == "launching":
        wait_step(deployment, "rpc-server", [JobState.RUNNING, JobState.SUCCEEDED])
    elif moment == "verifying":
        fault_lab.wait_state(deployment, [DeploymentState.VERIFYING, DeploymentState.RUNNING])
    else:
        fault_lab.wait_state(deployment, DeploymentState.RUNNING)
    if moment == "degraded":
        rpc = deployment.processes[f"rpc-server@{fault_lab.workers[0].name}"]
        subprocess.run(["kill", "-KILL", str(rpc["pid"])], check=True)
        wait_for(lambda: not pid_alive(int(rpc["pid"])), what="rpc-server to die")
        assert monitor.check_all() == [deployment.pk]
    seen = Deployment.objects.get(pk=deployment.pk).state
    deployment = _stop(fault_lab, deployment)
    assert deployment.state == DeploymentState.STOPPED, (
        seen,
        deployment.failed_step,
        deployment.state_reason,
    )
    assert not our_processes(fault_lab.hosts)
    assert_consistent(fault_lab, deployment)


def test_stop_pressed_again_while_stopping(fault_lab):
    deployment = fault_lab.ready()
    fault_lab.start_workers()
    assert lifecycle.start_deploy(deployment, fault_lab.operator)[0]
    fault_lab.wait_state(deployment, DeploymentState.RUNNING)
    assert lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk), fault_lab.operator)[0]
    again = lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk), fault_lab.operator)
    # Either the stop still waits in its queue (sent again, harmless) or it runs (refused as a duplicate).
    assert again in (
        (True, "Stopping: the stop was sent to a worker again."),
        (False, "A stop or rollback of this deployment is already running."),
    )
    deployment = fault_lab.settle(deployment)
    assert deployment.state == DeploymentState.STOPPED
    assert lifecycle.runs_of(deployment, lifecycle.UNDEPLOY).count() == 1
    assert_consistent(fault_lab, deployment)


def test_a_deployment_that_opted_in_heals_itself_after_its_rpc_server_dies(fault_lab, monkeypatch):
    deployment = fault_lab.deploy(fault_lab.ready(), monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, deployment.state_reason
    deployment.record(self_heal=True)
    rpc = deployment.processes[f"rpc-server@{fault_lab.workers[0].name}"]
    os.kill(int(rpc["pid"]), signal.SIGKILL)  # the laptop slept, or someone closed a terminal
    wait_for(lambda: not pid_alive(int(rpc["pid"])), what="rpc-server to die")

    started = time.monotonic()
    assert monitor.check_all() == [deployment.pk]  # degraded, and an attempt queued
    heal = run_latest(deployment.pk, lifecycle.HEAL)
    timed("self-heal after an rpc-server died", started)

    assert heal is not None and heal.state == JobState.SUCCEEDED, heal.result
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING and deployment.verification["problems"] == []
    fresh = deployment.processes[f"rpc-server@{fault_lab.workers[0].name}"]
    assert fresh["pid"] != rpc["pid"] and pid_alive(int(fresh["pid"]))
    assert monitor.check_all() == []
    assert AuditEvent.objects.filter(action="deployment.healed", object_id=str(deployment.pk)).exists()
    assert_consistent(fault_lab, deployment)
    deployment = fault_lab.stop(deployment, monkeypatch)
    assert_consistent(fault_lab, deployment)
