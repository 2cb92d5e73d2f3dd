"""Nobody but the coordinator reaches a worker's ggml-rpc-server (issue 11), proved on the lab with real sshd,
real llama.cpp and a third machine on the same network; and nobody but the console reaches the one a
calibration starts (issue 17).

Three hosts: the coordinator, one worker, and an outsider (a guest's phone on the Wi-Fi). While the
deployment serves completions, the outsider connects to the worker's RPC port and is refused: in tunnel
mode (rpc-server listens on 127.0.0.1; the coordinator comes through its SSH forward, whose key may do
that one forward and nothing else) and in direct mode with the firewall rule (rpc-server listens on the
LAN address; only the coordinator is admitted). Stopping removes the authorized key and the rule. The
outsider's refusals are printed (run with -s) and kept in the test's figures.

A calibration runs its rpc-servers on the node's loopback and times the link through the protection a
deployment would use there: the outsider connects to each of them once it listens and is refused, with the
node allowing tunnels (the link measured through SSH) and not (the link measured directly, behind the
firewall rule admitting only the console).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest
from django.conf import settings

from audit.models import AuditEvent
from deployments import monitor
from deployments.lifecycle import actions as lifecycle
from deployments.lifecycle import healing
from deployments.models import Deployment, DeploymentState
from jobs.models import Job, JobState
from llamacpp.gguf import profile_path
from llamacpp.rpc_guard import calibration_tag, tag_for
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import Device, DeviceKind
from planning import planner
from tests.deploy_fixtures import (
    LLAMA_PORT,
    MIB,
    RPC_PORT,
    Cluster,
    listeners_in,
    log_text,
    pid_alive,
    planner_nodes_of,
    ready_node,
    record_enqueued,
    route_between,
    run,
    tcp_connect_from,
    watch_rpc_servers,
)
from tests.llamacpp_build import use_cached_llamacpp
from tests.runs import run_deployment, run_latest

pytestmark = [
    pytest.mark.lab,
    pytest.mark.security,
    pytest.mark.llamacpp,
    pytest.mark.e2e,
    pytest.mark.timeout(1200),
    pytest.mark.django_db(transaction=True),
]


REFUSALS: list[str] = []


class Serving:
    """Completions sent one after another from a thread while the test probes the RPC port."""

    def __init__(self, deployment: Deployment, address: str):
        self.url = f"http://{address}:{LLAMA_PORT}/completion"
        self.key = deployment.api_key()
        self.answers: list[int] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stopping.is_set():
                answer = client.post(
                    self.url,
                    json={"prompt": "Once upon a time", "n_predict": 48, "cache_prompt": False},
                    headers={"Authorization": f"Bearer {self.key}"},
                )
                self.answers.append(
                    answer.json().get("tokens_predicted", 0) if answer.status_code == 200 else -1
                )

    def __enter__(self) -> Serving:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.answers and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.answers and self.answers[0] > 0, self.answers
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(timeout=150)
        assert self.answers and all(n > 0 for n in self.answers), self.answers


@pytest.fixture
def trio(lab, lab_hosts, tmp_path, settings):
    use_cached_llamacpp(settings)
    hosts = lab_hosts(3)
    route_between(hosts)
    cluster = Cluster(lab, hosts[:2], tmp_path)
    cluster.build_all()
    return cluster, hosts[2]


def iptables_rules(host) -> str:
    return subprocess.run(
        host.exec_argv(["iptables", "-w", "-S", "INPUT"]), capture_output=True, text=True, timeout=30
    ).stdout


def test_only_the_coordinator_reaches_the_rpc_server_in_tunnel_and_direct_mode(trio, monkeypatch):
    cluster, outsider = trio
    coordinator_host, worker_host = cluster.hosts
    worker = cluster.workers[0]
    authorized = worker_host.workdir / "authorized_keys"
    lab_key = authorized.read_text()

    # -- tunnel mode (the default: the worker allows tunnels) ----------------------------------------
    deployment = cluster.deploy(cluster.confirm(cluster.model()), monkeypatch)
    assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
    assert deployment.verification["problems"] == []
    row = next(r for r in deployment.verification["devices"].values() if r["node"] == worker.name)
    assert row["logged_weights"] > 0 and row["ok"]
    assert f"127.0.0.1:{RPC_PORT}" in listeners_in(worker_host, RPC_PORT)
    assert worker_host.address not in listeners_in(worker_host, RPC_PORT)
    tunnel = deployment.processes[f"rpc-tunnel@{worker.name}"]
    assert tunnel["node"] == cluster.coordinator.name and pid_alive(int(tunnel["pid"]))
    llama = deployment.processes[f"llama-server@{cluster.coordinator.name}"]
    assert llama["local_ends"] == {f"{worker.address}:{RPC_PORT}": tunnel["local_end"]}
    tag = tag_for(deployment.pk, worker.name, settings.RAMDECK_CONSOLE_ID)
    entry = next(line for line in authorized.read_text().splitlines() if line.endswith(tag))
    # From the coordinator's address as the worker sees it, and nowhere else.
    assert entry.startswith(
        f'restrict,from="{coordinator_host.address}",port-forwarding,pty,permitopen="127.0.0.1:{RPC_PORT}"'
    )
    assert 'command="sleep 2147483647"' in entry

    with Serving(deployment, cluster.coordinator.address):
        for address in (worker_host.address,):
            outcome = tcp_connect_from(outsider, address, RPC_PORT)
            REFUSALS.append(f"tunnel mode: {outcome}")
            assert "REFUSED" in outcome and "ConnectionRefusedError" in outcome, outcome
        # Even the coordinator itself cannot reach the port but through its tunnel.
        direct = tcp_connect_from(coordinator_host, worker_host.address, RPC_PORT)
        REFUSALS.append(f"tunnel mode: {direct}")
        assert "REFUSED" in direct, direct
        # The tunnel key may forward and do nothing else: the command asked for never runs (the forced
        # command only waits, until `timeout` ends the client; with a pty, as the tunnel asks, sshd ends the
        # forced command with the connection).
        marker = cluster.tmp_path / "shell-ran"
        shell = subprocess.run(
            coordinator_host.exec_argv(
                [
                    "timeout", "8", "ssh", "-tt", "-F", "/dev/null", "-i", tunnel["key_file"],
                    "-o", "BatchMode=yes",
                    "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                    "-o", "UserKnownHostsFile=/dev/null", f"root@{worker_host.address}",
                    f"echo SHELL-OK; touch {marker}",
                ]
            ),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "SHELL-OK" not in shell.stdout and not marker.exists(), (shell.stdout, shell.stderr)
        # The key copied to another machine of the LAN is refused there (from=).
        stolen = subprocess.run(
            outsider.exec_argv(
                [
                    "ssh", "-F", "/dev/null", "-i", tunnel["key_file"], "-o", "BatchMode=yes",
                    "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                    "-N", "-L", f"127.0.0.1:40999:127.0.0.1:{RPC_PORT}", f"root@{worker_host.address}",
                ]
            ),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert stolen.returncode == 255 and "Permission denied" in stolen.stderr, stolen.stderr
        REFUSALS.append(f"tunnel mode: the tunnel key from {outsider.address}: Permission denied")

    # The tunnel is supervised: when it dies the deployment is degraded, and a heal starts it again.
    subprocess.run(["kill", "-KILL", str(tunnel["pid"])], check=True)
    deadline = time.monotonic() + 10
    while pid_alive(int(tunnel["pid"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert monitor.check_all() == [deployment.pk]
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.DEGRADED and "rpc-tunnel" in deployment.state_reason
    deployment.self_heal = True
    deployment.save(update_fields=["self_heal"])
    record_enqueued(monkeypatch)
    assert healing.consider(deployment) is not None
    run_latest(deployment.pk, lifecycle.HEAL)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING, deployment.state_reason
    fresh = deployment.processes[f"rpc-tunnel@{worker.name}"]
    assert fresh["pid"] != tunnel["pid"] and pid_alive(int(fresh["pid"]))
    assert sum(line.endswith(tag) for line in authorized.read_text().splitlines()) == 1
    with Serving(deployment, cluster.coordinator.address):
        pass

    deployment = cluster.stop(deployment, monkeypatch)
    assert deployment.state == DeploymentState.STOPPED
    cluster.assert_clean(deployment)
    assert not pid_alive(int(fresh["pid"]))
    assert authorized.read_text() == lab_key  # the tunnel key is gone, the console's own login stays

    # -- direct mode with the firewall rule ------------------------------------------------------------
    Deployment.objects.filter(pk=deployment.pk).update(rpc_mode="direct")  # the operator's choice
    deployment.refresh_from_db()
    record_enqueued(monkeypatch)
    direct_deployment, started, message = lifecycle.redeploy(deployment, cluster.operator)
    assert started, message
    assert direct_deployment.rpc_mode == "direct"
    assert run_deployment(direct_deployment.pk) is not None
    direct_deployment.refresh_from_db()
    assert direct_deployment.state == DeploymentState.RUNNING, direct_deployment.state_reason
    assert f"{worker_host.address}:{RPC_PORT}" in listeners_in(worker_host, RPC_PORT)
    rule_tag = tag_for(direct_deployment.pk, worker.name)
    assert rule_tag in iptables_rules(worker_host)
    with Serving(direct_deployment, cluster.coordinator.address):
        outcome = tcp_connect_from(outsider, worker_host.address, RPC_PORT)
        REFUSALS.append(f"direct mode + firewall: {outcome}")
        assert "REFUSED" in outcome and "ConnectionRefusedError" in outcome, outcome
        admitted = tcp_connect_from(coordinator_host, worker_host.address, RPC_PORT)
        REFUSALS.append(f"direct mode + firewall: {admitted}")
        assert "CONNECTED" in admitted, admitted
    direct_deployment = cluster.stop(direct_deployment, monkeypatch)
    assert direct_deployment.state == DeploymentState.STOPPED
    assert rule_tag not in iptables_rules(worker_host)
    cluster.assert_clean(direct_deployment)
    assert AuditEvent.objects.filter(action="deployment.redeploy", changes__rpc_mode="direct").exists()
    print("\nRPC-ISOLATION " + json.dumps({"refusals": REFUSALS}))
    for line in REFUSALS:
        print("  " + line)


def _decode_tps(deployment: Deployment, address: str, samples: int) -> list[float]:
    key = deployment.api_key()
    figures = []
    with httpx.Client(timeout=120) as client:
        for _ in range(samples):
            answer = client.post(
                f"http://{address}:{LLAMA_PORT}/completion",
                json={"prompt": "Once upon a time", "n_predict": 64, "cache_prompt": False},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert answer.status_code == 200, answer.text
            figures.append(answer.json()["timings"]["predicted_per_second"])
    return figures


def _load_s(deployment: Deployment) -> float:
    """How long the llama-server step took: loading the model, the workers' weights sent over RPC."""
    job = deployment.steps.filter(name="llama-server").select_related("job").latest("order").job
    return (job.finished_at - job.started_at).total_seconds()


@pytest.fixture
def pair(lab, lab_hosts, tmp_path, settings):
    use_cached_llamacpp(settings)
    cluster = Cluster(lab, lab_hosts(2), tmp_path)
    cluster.build_all()
    return cluster


@pytest.mark.parametrize("samples", [9])
def test_tunnel_and_direct_mode_both_serve_and_report_their_speed(pair, monkeypatch, samples):
    """The figures of benchmarks/rpc_modes.py: decode tokens/s and model-load time, tunnel against direct."""
    cluster = pair
    # A model of some 70 MiB whose worker's share (~24 MiB of weights) crosses the link when it loads.
    path = write_tiny_llama(cluster.tmp_path / "speed.gguf", TinyLlama(n_layer=8, n_embd=768, n_ff=1536))
    profile = profile_path(path)
    model = ModelFile.objects.create(
        name="speed",
        node=cluster.coordinator,
        path=str(path),
        size_bytes=profile["size_bytes"],
        profile=profile,
    )
    for node, mib, gbs in ((cluster.coordinator, 24000, 2.0), (cluster.workers[0], 40, 40.0)):
        Device.objects.create(
            node=node,
            name="CPU",
            kind=DeviceKind.CPU,
            total_bytes=mib * MIB,
            free_bytes=mib * MIB,
            bandwidth_gbs=gbs,
        )
    plan = planner.plan(
        profile, planner_nodes_of(cluster.coordinator, cluster.workers), planner.Settings(ctx=512)
    )
    assert plan["fits"] and any(p["endpoint"] for p in plan["placements"] if p["layers"]), plan
    first = Deployment(
        model_file=model, coordinator=cluster.coordinator, plan=plan, plan_settings=plan["settings"]
    )
    figures = {}
    for mode in ("tunnel", "direct"):
        deployment = Deployment.objects.create(
            name=f"tiny-{mode}",
            model_file=first.model_file,
            coordinator=first.coordinator,
            plan=first.plan,
            plan_settings=first.plan_settings,
            port=LLAMA_PORT,
            rpc_mode=mode,
            created_by=cluster.operator,
        )
        deployment = cluster.deploy(deployment, monkeypatch)
        assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
        roles = {info["role"] for info in deployment.processes.values()}
        assert ("rpc-tunnel" in roles) == (mode == "tunnel")
        tps = _decode_tps(deployment, cluster.coordinator.address, samples)
        figures[f"{mode}_decode_tps"] = round(sorted(tps)[len(tps) // 2], 2)
        figures[f"{mode}_decode_samples"] = [round(v, 2) for v in tps]
        figures[f"{mode}_load_s"] = round(_load_s(deployment), 3)
        figures[f"{mode}_measure_step_tps"] = deployment.measured_decode_tps
        deployment = cluster.stop(deployment, monkeypatch)
        assert deployment.state == DeploymentState.STOPPED
        cluster.assert_clean(deployment)
    assert figures["tunnel_decode_tps"] > 0 and figures["direct_decode_tps"] > 0
    print("\nRPC-SPEED " + json.dumps(figures))


def test_a_third_host_is_refused_by_every_rpc_server_of_a_calibration(lab, lab_hosts, settings, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    settings.VAR_DIR = tmp_path
    node_host, outsider = lab_hosts(2)
    route_between([node_host, outsider])
    node = ready_node(lab, node_host, "old-pc")
    seen = watch_rpc_servers(monkeypatch, node_host, outsider)
    figures, refusals = {}, []

    # The node allows tunnels: every server listens on its loopback, the link is timed through SSH.
    job = run(Job.objects.create(kind="calibrate", node=node, title="Calibrate old-pc"))
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-3000:])
    log = log_text(job)
    assert "link: measured through an SSH tunnel" in log, log
    print("\n" + "\n".join(line for line in log.splitlines() if line.startswith("link")))
    node.refresh_from_db()
    assert node.link_rtt_ms > 0 and node.calibration["link_protection"] == "tunnel"
    figures["tunnel_link_rtt_ms"] = node.link_rtt_ms
    assert len(seen) >= 3, seen  # a server per device, the second of the pipeline run, the link's
    for server in seen:
        refusals.append(f"calibration, tunnel: port {server['port']}: {server['outsider']}")
        assert "127.0.0.1:" in server["listening"] and node_host.address not in server["listening"], server
        assert "REFUSED" in server["outsider"] and "ConnectionRefusedError" in server["outsider"], server

    # It does not: the link's server listens on the node's address, behind the rule admitting the console.
    seen.clear()
    node.rpc_tunnel = False
    node.save(update_fields=["rpc_tunnel"])
    job = run(Job.objects.create(kind="calibrate", node=node, title="Calibrate old-pc"))
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-3000:])
    tag = calibration_tag(job.pk, node.name)
    log = log_text(job)
    assert f"firewall rule {tag} admits only the console ({node_host.host_address})" in log, log
    print("\n".join(line for line in log.splitlines() if line.startswith("link")))
    node.refresh_from_db()
    assert node.link_rtt_ms > 0 and node.calibration["link_protection"] == "firewall"
    figures["direct_link_rtt_ms"] = node.link_rtt_ms
    exposed = [server for server in seen if node_host.address in server["listening"]]
    assert len(exposed) == 1 and exposed[0]["port"] == RPC_PORT, seen
    for server in seen:
        refusals.append(f"calibration, direct: {server['listening'].split()[3]}: {server['outsider']}")
        assert "REFUSED" in server["outsider"] and "ConnectionRefusedError" in server["outsider"], server
    assert tag not in iptables_rules(node_host)
    assert listeners_in(node_host, RPC_PORT) == ""
    print("\nRPC-CALIBRATION " + json.dumps({**figures, "refusals": refusals}))
