"""End to end on the lab, real all the way: three hosts over real sshd, the console's own build job (from the
llama.cpp source tarball, cached by source hash), a generated GGUF model, the planner, deploy, a completion
through the endpoint with the API key, the verified placement, stop — and nothing of ours left behind.

Scenario 2: a stale rpc-server on a worker's port is reaped and the deployment succeeds; a foreign process
on the coordinator's port makes the launch fail naming it, and is left alone. Scenario 3: a worker's
rpc-server dies while running and the periodic check marks the deployment degraded.

Phase times are printed (run with -s); they are not asserted.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from audit.models import AuditEvent
from builds.models import Build
from deployments import monitor
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState, ResourceClaim
from jobs.models import Job, JobLogLine, JobState
from llamacpp.source import file_sha256
from tests.deploy_fixtures import (
    LLAMA_PORT,
    RPC_PORT,
    Cluster,
    listeners_in,
    pid_alive,
    record_enqueued,
    route_between,
    start_in,
    stop_proc,
    wait_listening,
)
from tests.llamacpp_build import TARBALL, use_cached_llamacpp
from tests.runs import run_deployment, run_stop

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.timeout(1200),
    pytest.mark.django_db(transaction=True),
]

MIB = 2**20


@pytest.fixture
def cluster(lab, lab_hosts, tmp_path, settings):
    # Only the source is needed: the console's own build job compiles it when no build is cached yet
    # (the first run on a machine pays the 4-5 minutes; later runs find it by source hash).
    use_cached_llamacpp(settings)  # builds upload the pinned source and find it compiled
    return Cluster(lab, lab_hosts(3), tmp_path)


def test_build_plan_deploy_complete_verify_stop(cluster, monkeypatch):
    t0 = time.monotonic()
    cluster.build_all()
    builds = {b.node.name: b for b in Build.objects.select_related("node")}
    assert {b.rpc_protocol for b in builds.values()} == {"7.0.0"}
    assert {b.rpc_binary for b in builds.values()} == {"ggml-rpc-server"}
    assert {b.tarball_sha256 for b in builds.values()} == {file_sha256(str(TARBALL))}
    assert {b.build_dir for b in builds.values()} == {
        str(
            Path(settings.RAMDECK_BUILD_ROOT).expanduser()
            / f"src-{file_sha256(str(TARBALL))[:16]}/llama.cpp/build-cpu"
        )
    }
    cluster.times["build (all three)"] = time.monotonic() - t0

    deployment = cluster.confirm(cluster.model())
    rpc_nodes = {p["node"] for p in deployment.plan["placements"] if p["endpoint"]}
    assert rpc_nodes == {w.name for w in cluster.workers}

    t0 = time.monotonic()
    deployment = cluster.deploy(deployment, monkeypatch)
    cluster.times["deploy total"] = time.monotonic() - t0
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    assert deployment.verification["problems"] == []
    for worker in cluster.workers:
        row = next(r for r in deployment.verification["devices"].values() if r["node"] == worker.name)
        assert row["logged_weights"] > 0 and row["ok"]
    assert deployment.measured_decode_tps > 0 and deployment.measured_prompt_tps > 0

    url = f"http://{cluster.coordinator.address}:{LLAMA_PORT}"
    key = deployment.api_key()
    assert not JobLogLine.objects.filter(text__contains=key).exists()
    assert not JobLogLine.objects.filter(text__contains="****" + key[-4:]).exists()
    assert JobLogLine.objects.filter(text__contains="api_keys: (hidden)").exists()
    assert key and key not in json.dumps(list(Job.objects.values_list("params", flat=True)))
    assert not any(
        key in text
        for text in AuditEvent.objects.values_list("changes", flat=True).iterator()
        if isinstance(text, str)
    )
    answer = httpx.post(
        f"{url}/completion",
        json={"prompt": "hello", "n_predict": 8},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert answer.status_code == 200
    assert answer.json()["tokens_predicted"] > 0
    refused = httpx.post(f"{url}/completion", json={"prompt": "hello", "n_predict": 8}, timeout=30)
    assert refused.status_code == 401
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert metrics.status_code == 200 and "llamacpp:tokens_predicted_total" in metrics.text

    t0 = time.monotonic()
    deployment = cluster.stop(deployment, monkeypatch)
    cluster.times["stop"] = time.monotonic() - t0
    assert deployment.state == DeploymentState.STOPPED
    cluster.assert_clean(deployment)
    actions = set(AuditEvent.objects.values_list("action", flat=True))
    assert {"deployment.deploy", "deployment.running", "deployment.stop"} <= actions
    cluster.report(deployment)


def test_a_stale_rpc_server_is_reaped_and_a_foreign_port_holder_fails_the_launch(cluster, monkeypatch):
    cluster.build_all()
    model = cluster.model()
    worker_host = cluster.hosts[1]
    stale = start_in(
        worker_host,
        [
            Build.objects.get(node=cluster.workers[0]).rpc_server_path,
            "-H",
            worker_host.address,
            "-p",
            str(RPC_PORT),
        ],
        cluster.tmp_path / "stale.log",
    )
    try:
        assert f"pid={stale.pid}" in wait_listening(worker_host, RPC_PORT)
        deployment = cluster.deploy(cluster.confirm(model), monkeypatch)
        assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
        stale.wait(timeout=10)
        reap = deployment.steps.get(name="reap", job__node=cluster.workers[0]).job
        assert f"reaped rpc-server PID {stale.pid}" in reap.result
        assert AuditEvent.objects.filter(action="process.reaped").count() == 1
        deployment = cluster.stop(deployment, monkeypatch)
        cluster.assert_clean(deployment)
    finally:
        stop_proc(stale)

    coordinator_host = cluster.hosts[0]
    foreign = start_in(
        coordinator_host,
        ["python3", "-m", "http.server", str(LLAMA_PORT), "--bind", coordinator_host.address],
        cluster.tmp_path / "foreign.log",
    )
    try:
        wait_listening(coordinator_host, LLAMA_PORT)
        redo, started, message = lifecycle.redeploy(deployment, cluster.operator)
        assert started, message
        run_deployment(redo.pk)
        redo.refresh_from_db()
        assert redo.state == DeploymentState.FAILED
        assert redo.failed_step == "reap"
        assert "python3" in redo.state_reason and f"PID {foreign.pid}" in redo.state_reason
        assert foreign.poll() is None and pid_alive(foreign.pid)
        skipped = redo.steps.filter(job__state=JobState.CANCELLED).count()
        assert skipped >= 4  # rpc-servers, llama-server, verify, measure never ran
        for host in cluster.hosts[1:]:
            assert listeners_in(host, RPC_PORT) == ""
        assert not ResourceClaim.objects.filter(deployment=redo).exists()
    finally:
        stop_proc(foreign)


def test_a_dead_rpc_server_makes_the_deployment_degraded(cluster, monkeypatch):
    cluster.build_all()
    # An admin let one worker's rpc-server listen on every interface: it still works, with a warning.
    exposed = cluster.workers[1]
    exposed.rpc_bind_address = "0.0.0.0"
    exposed.save()
    deployment = cluster.confirm(cluster.model())
    deployment.rpc_mode = "direct"  # in tunnel mode (the default) every rpc-server listens on loopback
    deployment.save(update_fields=["rpc_mode"])
    deployment = cluster.deploy(deployment, monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    assert monitor.check_all() == []
    assert "0.0.0.0:50052" in listeners_in(cluster.hosts[2], RPC_PORT)
    assert AuditEvent.objects.filter(action="deployment.rpc_exposed").count() == 1
    victim = deployment.processes[f"rpc-server@{cluster.workers[0].name}"]
    subprocess.run(["kill", "-KILL", str(victim["pid"])], check=True)
    deadline = time.monotonic() + 10
    while pid_alive(int(victim["pid"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert monitor.check_all() == [deployment.pk]
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.DEGRADED
    assert f"PID {victim['pid']}" in deployment.state_reason
    # The reason carries the dead server's last log lines (here: its client connections).
    assert "Last log lines:" in deployment.state_reason
    assert "client connection" in deployment.state_reason
    deployment = cluster.stop(deployment, monkeypatch)
    assert deployment.state == DeploymentState.STOPPED
    cluster.assert_clean(deployment)


def test_a_model_llama_server_cannot_load_fails_with_its_log_and_rolls_back(cluster, monkeypatch):
    cluster.build_all()
    model = cluster.model()
    deployment = cluster.confirm(model)
    # Cut the file after its header: the plan is fine, llama.cpp's load is not.
    path = Path(model.path)
    path.write_bytes(path.read_bytes()[: 64 * 1024])
    deployment = cluster.deploy(deployment, monkeypatch)
    assert deployment.state == DeploymentState.FAILED
    assert deployment.failed_step == "llama-server"
    assert "exited while loading" in deployment.state_reason
    assert "Last log lines" in deployment.state_reason
    rollback = deployment.steps.filter(name="rollback")
    assert rollback.count() == 3  # the coordinator (llama-server) and both workers (rpc-servers)
    assert all(step.job.state == JobState.SUCCEEDED for step in rollback.select_related("job"))
    cluster.assert_clean(deployment)


def test_a_placement_llama_cpp_did_not_follow_fails_verification(cluster, monkeypatch):
    """The silent case: llama.cpp keeps every layer on the coordinator and still serves."""
    cluster.build_all()
    deployment = cluster.confirm(cluster.model())
    args = deployment.plan["llama_server_args"]
    args[args.index("-ngl") + 1] = "0"
    deployment.save(update_fields=["plan"])
    deployment = cluster.deploy(deployment, monkeypatch)
    assert deployment.state == DeploymentState.FAILED
    assert deployment.failed_step == "verify"
    assert "no RPC device received any weights" in deployment.state_reason
    cluster.assert_clean(deployment)


def test_restart_stops_and_deploys_the_same_plan_again(cluster, monkeypatch):
    cluster.build_all()
    first = cluster.deploy(cluster.confirm(cluster.model()), monkeypatch)
    assert first.state == DeploymentState.RUNNING, (first.failed_step, first.state_reason)
    calls = record_enqueued(monkeypatch)
    restarted, message = lifecycle.stop_deployment(first, cluster.operator, then_redeploy=True)
    assert restarted, message
    assert calls == [("undeploy", first.pk)]
    run_stop(first.pk)
    first.refresh_from_db()
    # It deploys again as a new run of the same deployment, not as a second one of the same name.
    assert first.state == DeploymentState.PREPARING and Deployment.objects.count() == 1
    assert calls[-1] == ("deploy", first.pk)
    run_deployment(first.pk)
    first.refresh_from_db()
    assert first.state == DeploymentState.RUNNING, (first.failed_step, first.state_reason)
    first = cluster.stop(first, monkeypatch)
    cluster.assert_clean(first)


def test_a_worker_out_of_reach_for_a_while_degrades_then_recovers(cluster, monkeypatch, settings):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 2.0
    cluster.build_all()
    deployment = cluster.deploy(cluster.confirm(cluster.model()), monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    worker_host = cluster.hosts[1]
    cluster.lab.link_down(worker_host)
    try:
        assert monitor.check_all() == [deployment.pk]
        deployment.refresh_from_db()
        assert deployment.state == DeploymentState.DEGRADED
        assert f"{cluster.workers[0].name} cannot be reached" in deployment.state_reason
    finally:
        cluster.lab.link_up(worker_host)
        # Its route to the other lab hosts went with the link (as a real machine's does until its network
        # setup brings it back): the coordinator's tunnel needs it to close cleanly when stopped.
        route_between([worker_host])
    degraded = monitor.check_all()
    deployment.refresh_from_db()
    assert degraded == [], deployment.state_reason
    assert deployment.state == DeploymentState.RUNNING
    assert AuditEvent.objects.filter(action="deployment.recovered").count() == 1
    deployment = cluster.stop(deployment, monkeypatch)
    cluster.assert_clean(deployment)
