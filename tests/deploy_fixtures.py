"""Helpers for the lifecycle tests on the lab: nodes for lab hosts, processes in a host, who holds a port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from pathlib import Path

from builds.models import Build, BuildSource
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, ResourceClaim
from jobs import on_node
from jobs.models import Job, JobState
from jobs.runner import run_job
from llamacpp.gguf import profile_path
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import CredentialKind, Device, DeviceKind, Node
from planning import planner
from tests.factories import CredentialFactory, NodeFactory, UserFactory
from tests.lab.netlab import kill_pid
from tests.llamacpp_build import TARBALL, require_llamacpp
from tests.runs import run_deployment, run_stop

MIB = 2**20


def build_dir() -> Path:
    """The cached llama.cpp build folder (built once per machine when missing)."""
    return require_llamacpp().build_dir


def rpc_server_binary() -> Path:
    """ggml-rpc-server of the cached build (built once per machine when missing)."""
    return require_llamacpp().rpc_server


def lab_node(lab, host, **fields) -> Node:
    """A Node for a lab host, reached over its real sshd with the lab's key, host key already approved."""
    credential = CredentialFactory(kind=CredentialKind.PRIVATE_KEY, secret=lab.client_private_key)
    options = {
        "name": host.netns.replace("rdlab-", "lab-"),
        "address": host.address,
        "ssh_user": "root",
        # The lab's sshd reads the keys from the host's folder; ~/.ssh is this machine's own (shared).
        "authorized_keys_path": str(host.workdir / "authorized_keys"),
        # Lab hosts share this machine's home: each keeps its RPC cache in its own folder, gone with it.
        "llama_cache_dir": str(host.workdir / "llama-cache"),
    }
    options.update(fields)
    node = NodeFactory(credential=credential, host_key=host.host_public_key, **options)
    return node


def start_in(host, argv: list[str], log: Path) -> subprocess.Popen:
    """Start argv inside the lab host's namespace (not through the console): a stale or foreign process."""
    handle = log.open("w")
    proc = subprocess.Popen(
        host.exec_argv(argv),
        stdout=handle,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    host.extra_pids.append(proc.pid)
    return proc


def listeners_in(host, port: int) -> str:
    """`ss -ltnp` of the host for one port (empty when nobody listens)."""
    result = subprocess.run(
        host.exec_argv(["ss", "-Hltnp", f"sport = :{port}"]), capture_output=True, text=True, timeout=30
    )
    return result.stdout.strip()


def wait_listening(host, port: int, timeout: float = 30.0) -> str:
    """The listener's `ss` line once it names its process: right after listen() ss can show the socket
    before it finds the process holding it (it reads every process's file descriptors meanwhile)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = listeners_in(host, port)
        if "pid=" in text:
            return text
        time.sleep(0.2)
    if text:
        return text
    raise AssertionError(f"nobody listens on {host.address}:{port} after {timeout:g} s")


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        kill_pid(proc.pid)
    proc.wait(timeout=10)


def run(job: Job) -> Job:

    run_job(job.pk)
    job.refresh_from_db()
    return job


def log_text(job: Job) -> str:
    return "\n".join(job.log_lines.order_by("seq").values_list("text", flat=True))


def route_between(hosts) -> None:
    """Let lab hosts reach each other (a coordinator must reach its workers' RPC ports).

    Forwarding is switched on only for packets arriving on the lab's own veth ends (removed with the lab),
    never machine-wide, and each namespace routes 10.77.0.0/16 through its host side.
    """
    for host in hosts:
        subprocess.run(
            ["sysctl", "-q", "-w", f"net.ipv4.conf.{host.veth_host}.forwarding=1"], check=True, timeout=30
        )
        subprocess.run(
            host.exec_argv(["ip", "route", "replace", "10.77.0.0/16", "via", host.host_address]),
            check=True,
            timeout=30,
        )


def record_enqueued(monkeypatch) -> list[tuple[str, int]]:
    """Jobs sent to a worker, as (kind, deployment pk), and not sent: the test runs them itself."""
    calls = []

    def send(job) -> bool:
        calls.append((job.kind, job.params.get("deployment")))
        return True

    monkeypatch.setattr(Job, "send_to_worker", send)
    return calls


LLAMA_PORT = 8080


RPC_PORT = 50052


def lab_devices(coordinator, workers) -> None:
    """Hardware as the probe would record it, with the workers' memory kept small so the planner has to
    split the model over both of them (all lab hosts really share this machine's RAM)."""
    Device.objects.create(
        node=coordinator,
        name="CPU",
        kind=DeviceKind.CPU,
        total_bytes=24000 * MIB,
        free_bytes=24000 * MIB,
        bandwidth_gbs=2.0,
    )
    for worker in workers:
        Device.objects.create(
            node=worker,
            name="CPU",
            kind=DeviceKind.CPU,
            total_bytes=12 * MIB,
            free_bytes=12 * MIB,
            bandwidth_gbs=40.0,
        )


def planner_nodes_of(coordinator, workers) -> list[planner.Node]:
    nodes = []
    for node in [coordinator, *workers]:
        devices = tuple(
            planner.Device(
                node.name, d.name, d.kind, d.total_bytes, d.free_bytes, d.effective_bandwidth_gbs or 20.0
            )
            for d in node.devices.all()
        )
        nodes.append(
            planner.Node(
                node.name,
                node.address,
                devices,
                coordinator=node == coordinator,
                rpc_port=node.rpc_port,
                rtt_ms=0.1,
            )
        )
    return nodes


def commands_in(host) -> list[str]:
    """The command lines of the processes in a lab host's namespace."""
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
    commands = []
    for pid in pids:
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            commands.append(raw.replace(b"\0", b" ").decode(errors="replace"))
    return commands


class Cluster:
    def __init__(self, lab, hosts, tmp_path):
        self.lab, self.hosts, self.tmp_path = lab, hosts, tmp_path
        route_between(hosts)
        self.operator = UserFactory(username="oscar-operator", role="operator")
        self.coordinator = lab_node(lab, hosts[0], name="desk", may_coordinate=True)
        self.workers = [lab_node(lab, h, name=f"old-pc-{i}") for i, h in enumerate(hosts[1:], start=1)]
        self.times: dict[str, float] = {}

    @property
    def nodes(self):
        return [self.coordinator, *self.workers]

    def build_all(self) -> None:
        for node in self.nodes:
            job = run(
                Job.objects.create(
                    kind="build",
                    node=node,
                    created_by=self.operator,
                    params={"source": "tarball", "tarball": str(TARBALL)},
                )
            )
            assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-2000:])
            self.times[f"build {node.name}"] = (job.finished_at - job.started_at).total_seconds()

    def model(self) -> ModelFile:
        path = write_tiny_llama(self.tmp_path / "tiny.gguf", TinyLlama(n_layer=8, n_embd=256))
        profile = profile_path(path)
        return ModelFile.objects.create(
            name="tiny",
            node=self.coordinator,
            path=str(path),
            size_bytes=profile["size_bytes"],
            profile=profile,
        )

    def confirm(self, model: ModelFile) -> Deployment:
        lab_devices(self.coordinator, self.workers)
        plan = planner.plan(
            model.profile, planner_nodes_of(self.coordinator, self.workers), planner.Settings(ctx=512)
        )
        assert plan["fits"], plan
        return Deployment.objects.create(
            name="tiny",
            model_file=model,
            coordinator=self.coordinator,
            plan=plan,
            plan_settings=plan["settings"],
            port=LLAMA_PORT,
            created_by=self.operator,
        )

    def deploy(self, deployment: Deployment, monkeypatch) -> Deployment:
        enqueued = record_enqueued(monkeypatch)
        started, message = lifecycle.start_deploy(deployment, self.operator)
        assert started, message
        assert enqueued == [("deploy", deployment.pk)]
        again, _ = lifecycle.start_deploy(Deployment.objects.get(pk=deployment.pk), self.operator)
        assert not again  # pressing deploy twice starts one deployment
        run_deployment(deployment.pk)
        deployment.refresh_from_db()
        for step in deployment.steps.select_related("job").order_by("order"):
            job = step.job
            if job.started_at and job.finished_at:
                key = f"{step.order:02d} {step.name} {job.node_name}"
                self.times[key] = (job.finished_at - job.started_at).total_seconds()
        return deployment

    def stop(self, deployment: Deployment, monkeypatch) -> Deployment:
        record_enqueued(monkeypatch)
        stopped, message = lifecycle.stop_deployment(deployment, self.operator)
        assert stopped, message
        run_stop(deployment.pk)
        deployment.refresh_from_db()
        return deployment

    def assert_clean(self, deployment: Deployment) -> None:
        """No rpc-server or llama-server of this deployment runs, and every port it used is free."""
        for info in deployment.processes.values():
            assert not pid_alive(int(info["pid"])), info
        for host in self.hosts:
            for port in (RPC_PORT, LLAMA_PORT):
                assert listeners_in(host, port) == "", (host.address, port)
            for cmd in commands_in(host):
                assert "rpc-server" not in cmd and "llama-server" not in cmd, cmd
            # A tunnel's forced command on a worker ends when its sshd sees the connection close (soon after
            # the coordinator's ssh was ended, not at once).
            deadline = time.monotonic() + 15
            while any("sleep 2147483647" in cmd for cmd in commands_in(host)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not [cmd for cmd in commands_in(host) if "sleep 2147483647" in cmd], host.address
        assert not ResourceClaim.objects.filter(deployment=deployment).exists()
        for host in self.hosts:  # no tunnel key of a deployment is left on a worker
            assert "ramdeck-d" not in (host.workdir / "authorized_keys").read_text()

    def report(self, deployment: Deployment) -> None:
        figures = {
            "phase_seconds": {k: round(v, 2) for k, v in self.times.items()},
            "measured_decode_tps": deployment.measured_decode_tps,
            "measured_prompt_tps": deployment.measured_prompt_tps,
            "predicted_tps": deployment.plan.get("predicted_tokens_per_s"),
        }
        print("\nE2E " + json.dumps(figures))


def ready_node(lab, host, name: str, **fields) -> Node:
    """A lab node that the probe has seen, with the cached llama.cpp build registered as its build."""
    binaries = require_llamacpp()
    node = lab_node(lab, host, name=name, **fields)
    probe = run(Job.objects.create(kind="probe", node=node))
    assert probe.state == JobState.SUCCEEDED, probe.result
    Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        source=str(binaries.build_dir),
        version="test build",
        rpc_protocol="7.0.0",
        rpc_server_path=str(binaries.rpc_server),
        llama_server_path=str(binaries.llama_server),
    )
    node.refresh_from_db()
    return node


# Connect from a host's namespace; print what happened in one line.
CONNECT_SCRIPT = """
import socket, sys
s = socket.socket()
s.settimeout(5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("CONNECTED", sys.argv[1], sys.argv[2])
except OSError as exc:
    print("REFUSED", sys.argv[1], sys.argv[2], type(exc).__name__, exc)
"""


def tcp_connect_from(host, address: str, port: int) -> str:
    result = subprocess.run(
        host.exec_argv(["python3", "-c", CONNECT_SCRIPT, address, str(port)]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    line = result.stdout.strip() or result.stderr.strip()
    return f"from {host.address}: {line}"


def watch_rpc_servers(monkeypatch, host, outsider) -> list[dict]:
    """Every rpc-server a calibration starts, once it listens: what listens on its port, and what a third
    host gets when it connects to the node's address there."""
    seen: list[dict] = []
    wait = on_node.wait_listening

    async def watched(ctx, pid, port, log_path, *, timeout):
        await wait(ctx, pid, port, log_path, timeout=timeout)
        listening = await asyncio.to_thread(listeners_in, host, port)
        outcome = await asyncio.to_thread(tcp_connect_from, outsider, host.address, port)
        seen.append({"port": port, "listening": listening, "outsider": outcome})

    monkeypatch.setattr("calibration.job.wait_listening", watched)
    return seen


class StepContext:
    """The part of jobs.context.JobContext a step body uses, with the log kept in a list."""

    def __init__(self, job_params: dict, node=None, transport=None):
        self.job = type("J", (), {"params": job_params, "created_by": None, "created_by_id": None})()
        self.node = node
        self.transport = transport
        self.lines: list[str] = []

    async def log(self, text: str, stream: str = "system") -> None:
        self.lines.append(text)

    def cancelled(self) -> bool:
        return False


def step_deployment(node, port: int = 8080, **fields) -> Deployment:
    model = ModelFile.objects.create(name=f"m{port}", node=node, path=f"/m/tiny-{port}.gguf")
    deployment = Deployment.objects.create(
        name="tiny",
        model_file=model,
        coordinator=node,
        plan={"llama_server_args": [], "placements": [], "predicted_tokens_per_s": 10.0},
        port=port,
        **fields,
    )
    deployment.set_api_key("k")
    deployment.save(update_fields=["api_key_encrypted"])
    return deployment
