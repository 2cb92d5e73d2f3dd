"""Deployment state changes and the database-enforced claims on ports and devices."""

from __future__ import annotations

import pytest

from deployments.models import ClaimConflict, Deployment, DeploymentState, ResourceClaim
from modelfiles.models import ModelFile
from tests.factories import NodeFactory
from tests.runs import run_deployment, run_stop

pytestmark = pytest.mark.django_db


def _plan(worker: str, coordinator: str, rpc_port: int = 50052) -> dict:
    return {
        "fits": True,
        "placements": [
            {
                "node": worker,
                "device": "CPU",
                "llama_device": "RPC0",
                "endpoint": f"10.77.1.2:{rpc_port}",
                "layers": 6,
                "output_layer": False,
            },
            {
                "node": coordinator,
                "device": "CPU",
                "llama_device": "CPU",
                "endpoint": None,
                "layers": 2,
                "output_layer": True,
            },
        ],
    }


@pytest.fixture
def cluster():
    coordinator = NodeFactory(name="desk", may_coordinate=True)
    worker = NodeFactory(name="old-pc")
    model = ModelFile.objects.create(name="tiny", node=coordinator, path="/m/tiny.gguf")
    return coordinator, worker, model


def _deployment(cluster, *, port: int = 8080, rpc_port: int = 50052) -> Deployment:
    coordinator, worker, model = cluster
    return Deployment.objects.create(
        name="tiny",
        model_file=model,
        coordinator=coordinator,
        port=port,
        plan=_plan(worker.name, coordinator.name, rpc_port),
    )


def test_pressing_deploy_twice_moves_to_preparing_once(cluster):
    deployment = _deployment(cluster)
    assert deployment.mark_preparing() is True
    again = Deployment.objects.get(pk=deployment.pk)
    assert again.mark_preparing() is False
    assert ResourceClaim.objects.filter(deployment=deployment).count() == 4


def test_claims_cover_the_rpc_port_the_llama_server_port_and_used_devices(cluster):
    deployment = _deployment(cluster)
    assert ResourceClaim.wanted_by(deployment) == [
        ("desk", "device:CPU"),
        ("desk", "port:8080"),
        ("old-pc", "device:CPU"),
        ("old-pc", "port:50052"),
    ]


def test_a_second_deployment_on_the_same_rpc_port_is_refused_and_stays_confirmed(cluster):
    first = _deployment(cluster)
    first.mark_preparing()
    second = _deployment(cluster, port=8081)
    with pytest.raises(ClaimConflict, match="old-pc is held by deployment tiny"):
        second.mark_preparing()
    second.refresh_from_db()
    assert second.state == DeploymentState.CONFIRMED
    assert second.started_at is None
    assert not ResourceClaim.objects.filter(deployment=second).exists()


def test_the_unique_constraint_holds_even_without_the_model_method(cluster):
    from django.db import IntegrityError, transaction

    first = _deployment(cluster)
    first.mark_preparing()
    second = _deployment(cluster, port=8081)
    with pytest.raises(IntegrityError), transaction.atomic():
        ResourceClaim.objects.create(node=cluster[1], resource="port:50052", deployment=second)


def test_failing_releases_the_claims_so_the_plan_can_be_deployed_again(cluster):
    first = _deployment(cluster)
    first.mark_preparing()
    assert first.fail("reap", "port 50052 is held by python3") is True
    first.refresh_from_db()
    assert (first.state, first.failed_step) == (DeploymentState.FAILED, "reap")
    assert not first.claims.exists()
    second = _deployment(cluster)
    assert second.mark_preparing() is True


def test_the_happy_path_runs_in_order_and_stopping_releases_claims(cluster):
    deployment = _deployment(cluster)
    assert deployment.mark_launching() is False  # not from confirmed
    assert deployment.mark_preparing()
    assert deployment.mark_launching()
    assert deployment.mark_verifying()
    assert deployment.mark_running()
    assert deployment.mark_degraded("rpc-server on old-pc died")
    assert deployment.mark_recovered()
    assert deployment.mark_stopping()
    assert deployment.mark_stopping() is False  # idempotent
    assert deployment.mark_stopped()
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED
    assert deployment.stopped_at is not None
    assert not deployment.claims.exists()


def test_a_terminal_deployment_cannot_fail_or_run_again(cluster):
    deployment = _deployment(cluster)
    deployment.mark_preparing()
    deployment.fail("launch", "llama-server exited")
    assert deployment.fail("verify", "again") is False
    assert deployment.mark_stopping() is False
    deployment.refresh_from_db()
    assert deployment.failed_step == "launch"


def test_different_ports_on_different_nodes_do_not_conflict(cluster):
    first = _deployment(cluster)
    first.mark_preparing()
    coordinator2 = NodeFactory(name="desk2", may_coordinate=True)
    worker2 = NodeFactory(name="old-pc2")
    other = Deployment.objects.create(
        name="other",
        model_file=cluster[2],
        coordinator=coordinator2,
        plan=_plan(worker2.name, coordinator2.name),
    )
    assert other.mark_preparing() is True


# -- start_deploy: refusals before anything runs, one run per press --------------------------------------


def _build(node, protocol: str = "7.0.0"):
    from builds.models import Build, BuildSource

    return Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        rpc_protocol=protocol,
        rpc_server_path="/opt/llama/ggml-rpc-server",
        llama_server_path="/opt/llama/llama-server",
    )


@pytest.fixture
def no_enqueue(monkeypatch):
    """Jobs the test would send to a worker, as (kind, deployment pk); nothing is sent."""
    from jobs.models import Job

    calls = []

    def send(job) -> bool:
        calls.append((job.kind, job.params.get("deployment")))
        return True

    monkeypatch.setattr(Job, "send_to_worker", send)
    return calls


def _ready(cluster) -> Deployment:
    deployment = _deployment(cluster)
    deployment.plan["llama_server_args"] = ["--rpc", "10.77.1.2:50052", "--device", "RPC0"]
    deployment.save()
    return deployment


def test_a_node_without_a_build_is_refused_by_name(cluster, no_enqueue):
    from audit.models import AuditEvent
    from deployments.lifecycle.actions import start_deploy

    deployment = _ready(cluster)
    _build(cluster[0])
    started, reason = start_deploy(deployment)
    assert not started
    assert reason.startswith("old-pc has no llama.cpp build")
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.CONFIRMED
    assert not deployment.steps.exists() and no_enqueue == []
    assert AuditEvent.objects.get(action="deployment.refused").changes["reason"] == reason


def test_nodes_speaking_different_rpc_protocols_are_refused(cluster, no_enqueue):
    from deployments.lifecycle.actions import start_deploy

    deployment = _ready(cluster)
    _build(cluster[0], "7.0.0")
    _build(cluster[1], "3.0.0")
    started, reason = start_deploy(deployment)
    assert not started
    assert "old-pc speaks 3.0.0" in reason


def test_a_windows_worker_is_reached_directly_and_a_windows_coordinator_is_refused(cluster, no_enqueue):
    from deployments.lifecycle.actions import refusal, rpc_mode, start_deploy
    from deployments.models import RpcMode

    coordinator, worker, _ = cluster
    deployment = _ready(cluster)
    _build(coordinator)
    _build(worker)
    worker.platform_hint = "windows"
    worker.save()
    deployment = Deployment.objects.get(pk=deployment.pk)
    assert rpc_mode(deployment) == RpcMode.DIRECT  # auto: Windows' sshd gets no tunnel (not built yet)
    deployment.record(rpc_mode=RpcMode.TUNNEL)
    assert refusal(deployment).startswith(
        "old-pc runs Windows, where the console cannot set up the RPC tunnel yet"
    )
    coordinator.platform_hint = "windows"
    coordinator.save()
    started, reason = start_deploy(Deployment.objects.get(pk=deployment.pk))
    assert not started and reason.startswith("desk runs Windows, which can lend its memory as a worker")
    assert not deployment.steps.exists() and no_enqueue == []


def test_a_node_being_calibrated_is_refused_until_its_calibration_ends(cluster, no_enqueue):
    from deployments.lifecycle.actions import start_deploy
    from jobs.models import Job, JobState

    deployment = _ready(cluster)
    _build(cluster[0])
    _build(cluster[1])
    calibration = Job.objects.create(kind="calibrate", node=cluster[1], title="Calibrate old-pc")
    Job.objects.filter(pk=calibration.pk).update(state=JobState.RUNNING)
    started, reason = start_deploy(deployment)
    assert not started
    assert reason == "old-pc is being calibrated (Calibrate old-pc): deploy once that job ends."
    assert not deployment.steps.exists() and no_enqueue == []
    Job.objects.filter(pk=calibration.pk).update(state=JobState.SUCCEEDED)
    assert start_deploy(Deployment.objects.get(pk=deployment.pk))[0] is True


def test_deploy_pressed_twice_creates_one_ordered_run(
    cluster, no_enqueue, django_capture_on_commit_callbacks
):
    from deployments.lifecycle.actions import start_deploy

    deployment = _ready(cluster)
    _build(cluster[0])
    _build(cluster[1])
    with django_capture_on_commit_callbacks(execute=True):
        assert start_deploy(deployment)[0] is True
        assert start_deploy(Deployment.objects.get(pk=deployment.pk))[0] is False
    names = list(deployment.steps.order_by("order").values_list("name", "job__node__name"))
    assert names == [
        ("reap", "old-pc"),
        ("reap", "desk"),
        ("rpc-server", "old-pc"),
        ("rpc-tunnel", "desk"),
        ("preflight", "desk"),
        ("llama-server", "desk"),
        ("verify", "desk"),
        ("measure", "desk"),
    ]
    rpc = deployment.steps.get(name="rpc-server").job
    assert "-c" not in rpc.params["args"]  # the rpc_server step adds the cache by the node's limit
    # Tunnel mode (the default when every worker allows it): rpc-server listens on loopback only.
    assert rpc.params["args"][rpc.params["args"].index("-H") + 1] == "127.0.0.1"
    tunnel = deployment.steps.get(name="rpc-tunnel").job
    assert tunnel.params["endpoint"] == "10.77.1.2:50052" and tunnel.params["port"] == 50052
    assert no_enqueue == [("deploy", deployment.pk)]


@pytest.mark.django_db(transaction=True)  # the runner works on its own database connection
def test_stop_pressed_before_the_first_step_skips_every_step_and_stops(
    cluster, no_enqueue, django_capture_on_commit_callbacks
):
    from deployments.lifecycle.actions import DEPLOY, runs_of, start_deploy, stop_deployment
    from jobs.models import JobState

    deployment = _ready(cluster)
    _build(cluster[0])
    _build(cluster[1])
    with django_capture_on_commit_callbacks(execute=True):
        assert start_deploy(deployment)[0]
        assert stop_deployment(Deployment.objects.get(pk=deployment.pk))[0]
    assert no_enqueue == [("deploy", deployment.pk), ("undeploy", deployment.pk)]
    # The queued run was cancelled at once, its steps with it: a late delivery of its message does nothing.
    assert runs_of(deployment, DEPLOY).get().state == JobState.CANCELLED
    assert run_deployment(deployment.pk) is None
    assert run_stop(deployment.pk).state == JobState.SUCCEEDED
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED
    assert set(deployment.steps.values_list("job__state", flat=True)) == {JobState.CANCELLED}
    assert not deployment.claims.exists()


def test_a_second_delivery_of_the_run_leaves_it_to_the_first(cluster, no_enqueue):
    from deployments.lifecycle.actions import DEPLOY, runs_of, start_deploy
    from jobs import runner

    deployment = _ready(cluster)
    _build(cluster[0])
    _build(cluster[1])
    assert start_deploy(deployment)[0]
    run = runs_of(deployment, DEPLOY).get()
    run.mark_running(worker="celery@first")
    assert runner.run_job(run.pk) is False
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.PREPARING
    assert deployment.steps.filter(job__state="queued").count() == 8


def test_stop_is_refused_for_a_deployment_that_is_not_active(cluster, no_enqueue):
    from deployments.lifecycle.actions import stop_deployment

    deployment = _ready(cluster)
    assert stop_deployment(deployment) == (False, "This deployment is confirmed: nothing to stop.")
    assert no_enqueue == []


def test_a_wildcard_rpc_bind_is_used_audited_and_warned_about(cluster, no_enqueue, client, operator_user):
    from django.urls import reverse

    from audit.models import AuditEvent
    from deployments.lifecycle.actions import start_deploy

    worker = cluster[1]
    worker.rpc_bind_address = "0.0.0.0"
    worker.save()
    assert worker.rpc_endpoint_host == worker.address  # coordinators still connect to its address
    deployment = _ready(cluster)
    deployment.rpc_mode = "direct"  # the operator's choice: in tunnel mode it would listen on loopback
    deployment.save()
    _build(cluster[0])
    _build(cluster[1])
    assert start_deploy(deployment, operator_user)[0]
    args = deployment.steps.get(name="rpc-server").job.params["args"]
    assert args[args.index("-H") + 1] == "0.0.0.0"
    event = AuditEvent.objects.get(action="deployment.rpc_exposed")
    assert event.changes == {"node": "old-pc", "bind": "0.0.0.0", "port": 50052}
    client.force_login(operator_user)
    page = client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert "ggml-rpc-server listens on every interface on old-pc (0.0.0.0:50052)" in page
