"""The preflight step on the lab: the coordinator itself reaches each worker's ggml-rpc-server before
llama-server starts (through its tunnel in tunnel mode), and a port that a firewall on the worker blocks
stops the deployment there, naming the node, the port, the likely cause and the command that lets the
coordinator in, with nothing left running (real sshd, real iptables, real llama.cpp)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from builds.models import Build, BuildSource
from deployments.models import DeploymentState
from jobs.models import JobState
from tests.deploy_fixtures import RPC_PORT, Cluster, log_text, tcp_connect_from
from tests.llamacpp_build import require_llamacpp
from tests.unavailable import unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.timeout(600),
    pytest.mark.django_db(transaction=True),
]


def _registered(cluster: Cluster) -> Cluster:
    binaries = require_llamacpp()
    for node in cluster.nodes:
        Build.objects.create(
            node=node,
            source_kind=BuildSource.EXISTING,
            source=str(binaries.build_dir),
            version="test build",
            rpc_protocol="7.0.0",
            rpc_server_path=str(binaries.rpc_server),
            llama_server_path=str(binaries.llama_server),
        )
    return cluster


def _step(deployment, name: str):
    return deployment.steps.filter(name=name).select_related("job").latest("order").job


def iptables_input(host) -> str:
    return subprocess.run(
        host.exec_argv(["iptables", "-w", "-S", "INPUT"]), capture_output=True, text=True, timeout=30
    ).stdout


def test_the_coordinator_reaches_its_worker_through_the_tunnel_before_llama_server_starts(
    lab, lab_hosts, tmp_path, monkeypatch
):
    cluster = _registered(Cluster(lab, lab_hosts(2), tmp_path))
    deployment = cluster.deploy(cluster.confirm(cluster.model()), monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    preflight = _step(deployment, "preflight")
    assert preflight.state == JobState.SUCCEEDED, preflight.result
    (figure,) = preflight.params["reached"]
    assert figure["node"] == cluster.workers[0].name and figure["port"] == RPC_PORT
    assert 0 < figure["rtt_ms"] < 1000
    assert "through its tunnel (127.0.0.1:" in log_text(preflight)
    assert preflight.finished_at <= _step(deployment, "llama-server").started_at
    # Kept for the pair: the next plan with this coordinator prices the worker's link with it.
    worker = cluster.workers[0]
    worker.refresh_from_db()
    stored = worker.coordinator_links[str(cluster.coordinator.pk)]
    assert (stored["source"], stored["rtt_ms"]) == ("preflight", figure["rtt_ms"])
    cluster.assert_clean(cluster.stop(deployment, monkeypatch))


def test_a_port_the_workers_firewall_drops_stops_the_deploy_at_the_preflight(
    lab, lab_hosts, tmp_path, monkeypatch
):
    if shutil.which("iptables") is None:
        unavailable("iptables is missing (make test installs it)")
    cluster = _registered(Cluster(lab, lab_hosts(2), tmp_path))
    coordinator_host, worker_host = cluster.hosts
    worker = cluster.workers[0]
    # The worker's own firewall drops the RPC port (as `ufw default deny incoming` does); appended, so the
    # deployment's own rule (inserted above it, refusing everyone but the coordinator) does not change it.
    subprocess.run(
        worker_host.exec_argv(
            ["iptables", "-w", "-A", "INPUT", "-p", "tcp", "--dport", str(RPC_PORT), "-j", "DROP"]
        ),
        check=True,
        timeout=30,
    )
    confirmed = cluster.confirm(cluster.model())
    confirmed.rpc_mode = "direct"
    confirmed.save(update_fields=["rpc_mode"])

    deployment = cluster.deploy(confirmed, monkeypatch)

    assert deployment.state == DeploymentState.FAILED and deployment.failed_step == "preflight"
    reason = deployment.state_reason
    assert f"desk cannot reach {worker.name}'s ggml-rpc-server on port {RPC_PORT}" in reason
    assert "connect: Connection timed out" in reason
    assert "a firewall on the worker (or between the two machines) drops the coordinator's packets" in reason
    # The worker has neither ufw nor firewalld, only iptables: the fix is in iptables' words.
    fix = f"sudo iptables -I INPUT -p tcp -s {coordinator_host.address} --dport {RPC_PORT} -j ACCEPT"
    assert reason.endswith(f"To let the coordinator in, run on {worker.name}: {fix}.")
    # The rpc-server had started and listened; llama-server never started; the rollback ended everything.
    assert _step(deployment, "rpc-server").state == JobState.SUCCEEDED
    assert _step(deployment, "llama-server").started_at is None
    cluster.assert_clean(deployment)
    assert "ramdeck" not in iptables_input(worker_host)  # the deployment's own rule is gone too

    # The command it named lets the coordinator through: its connection now reaches the worker (refused, as
    # nothing listens there any more) where it timed out before.
    assert "TimeoutError" in tcp_connect_from(coordinator_host, worker_host.address, RPC_PORT)
    subprocess.run(worker_host.exec_argv(fix.removeprefix("sudo ").split()), check=True, timeout=30)
    assert "ConnectionRefusedError" in tcp_connect_from(coordinator_host, worker_host.address, RPC_PORT)
