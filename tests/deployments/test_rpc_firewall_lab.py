"""Direct mode's firewall rule on the lab (issue 17): real sshd, real iptables, real sudo, real llama.cpp.

- The rpc-server step inserts the rule before ggml-rpc-server starts (a wrapper in front of the real binary
  lists the host's INPUT chain at the moment the server process begins), and a step that fails after
  inserting it (the server exits before listening, or listens and then the plan no longer fits) ends the
  server and takes the rule out itself.
- The sudoers line the README documents lets a node's SSH user run exactly the console's two iptables
  commands, and the console's check asks sudo about exactly those (a user who may run `sudo -n true` but
  not iptables is not taken for one who may set the rule).
- A calibration of a node that allows no tunnels, as a user who may not set the rule, skips the link
  measurement with a log line saying why and opens nothing; with the documented sudoers line the same
  user's calibration measures it behind the rule.

The lab's hosts log in as root by default; the other user lives inside its host only (Lab.add_plain_login).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from builds.models import Build, BuildSource
from deployments.models import Deployment
from jobs.models import Job, JobState
from llamacpp import rpc_guard
from modelfiles.models import ModelFile
from nodes.guards import may_administer
from nodes.models import Node
from nodes.transports import transport_for
from tests.deploy_fixtures import (
    lab_node,
    listeners_in,
    log_text,
    pid_alive,
    route_between,
    run,
    watch_rpc_servers,
)
from tests.lab.netlab import PASSWORD_USER, PLAIN_UID
from tests.llamacpp_build import require_llamacpp
from tests.unavailable import unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.security,
    pytest.mark.timeout(900),
    pytest.mark.django_db(transaction=True),
]

RPC_PORT = 50052


def iptables_rules(host) -> str:
    return subprocess.run(
        host.exec_argv(["iptables", "-w", "-S", "INPUT"]), capture_output=True, text=True, timeout=30
    ).stdout


def iptables_path() -> str:
    path = shutil.which("iptables")
    if path is None:
        unavailable("iptables is missing (make test installs it)")
    return str(Path(path))


def require_sudo() -> None:
    if shutil.which("sudo") is None:
        unavailable("sudo is missing (make test installs it)")


def register_build(node: Node, rpc_server: Path, llama_server: Path) -> None:
    Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        source=str(rpc_server.parent),
        version="test build",
        rpc_protocol="7.0.0",
        rpc_server_path=str(rpc_server),
        llama_server_path=str(llama_server),
    )


def wrapped_rpc_server(host, real: Path) -> tuple[Path, Path]:
    """A `ggml-rpc-server` in front of the real one that first appends, to a record file, the host's INPUT
    chain and the RPC port's listeners at the moment it starts, then becomes the real server (same PID).
    With a file `fail` beside it, it exits instead (a server that never listens). (wrapper, record)"""
    folder = host.workdir / "wrapped"
    folder.mkdir(exist_ok=True)
    record, wrapper = folder / "at-start.txt", folder / "ggml-rpc-server"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'{{ echo "=== start $*"; iptables -w -S INPUT; echo "--- listening"; '
        f'ss -Hltn "sport = :{RPC_PORT}"; }} >> "{record}" 2>&1\n'
        f'[ -e "{folder / "fail"}" ] && exit 3\n'
        f'exec "{real}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper, record


def rpc_server_step(deployment: Deployment, node: Node, host, tag: str, **params) -> Job:
    """The direct-mode rpc-server step as a deployment run creates it (deployments/lifecycle/actions.py)."""
    args = ["-H", host.address, "-p", str(RPC_PORT), "-d", "CPU"]
    return Job.objects.create(
        kind="rpc_server",
        node=node,
        title=f"Start ggml-rpc-server on {node}",
        params={
            "deployment": deployment.pk,
            "port": RPC_PORT,
            "args": args,
            "bind": host.address,
            "exposed": False,
            "firewall": {"coordinator": host.host_address, "tag": tag},
            "needs": {},
            **params,
        },
    )


@pytest.mark.llamacpp
def test_the_rule_goes_in_before_the_rpc_server_starts_and_out_when_the_step_fails(lab, lab_host):
    binaries = require_llamacpp()
    node = lab_node(lab, lab_host, name="old-pc")
    wrapper, record = wrapped_rpc_server(lab_host, binaries.rpc_server)
    register_build(node, wrapper, binaries.llama_server)
    model = ModelFile.objects.create(name="m", node=node, path="/m/tiny.gguf")
    deployment = Deployment.objects.create(
        name="tiny", model_file=model, coordinator=node, plan={}, port=8080
    )
    tag = rpc_guard.tag_for(deployment.pk, node.name)

    # It starts: the rule was in the chain when the server process began, before anything listened.
    job = run(rpc_server_step(deployment, node, lab_host, tag))
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-2000:])
    at_start = record.read_text()
    chain, listening = at_start.split("--- listening")
    assert tag in chain and f"! -s {lab_host.host_address}/32" in chain, at_start
    assert listening.strip() == "", at_start
    assert tag in iptables_rules(lab_host)
    assert f"{lab_host.address}:{RPC_PORT}" in listeners_in(lab_host, RPC_PORT)
    log = log_text(job)
    assert log.index("firewall: port") < log.index("[rpc-server]"), log
    deployment.refresh_from_db()
    server = deployment.processes[f"rpc-server@{node.name}"]
    stop = run(
        Job.objects.create(
            kind="stop",
            node=node,
            params={
                "deployment": deployment.pk,
                "processes": [server],
                "guards": list(deployment.guards.values()),
            },
        )
    )
    assert stop.state == JobState.SUCCEEDED, stop.result
    assert tag not in iptables_rules(lab_host) and listeners_in(lab_host, RPC_PORT) == ""

    # It listens, then the step fails (the plan asks for a device the server does not offer): the step ends
    # the server, then takes the rule out.
    record.write_text("")
    job = run(rpc_server_step(deployment, node, lab_host, tag, needs={"CUDA0": 1}))
    assert job.state == JobState.FAILED and "does not offer device CUDA0" in job.result, job.result
    assert tag in record.read_text()
    deployment.refresh_from_db()
    pid = int(deployment.processes[f"rpc-server@{node.name}"]["pid"])
    assert not pid_alive(pid)
    assert tag not in iptables_rules(lab_host), iptables_rules(lab_host)
    assert f"the step failed: firewall rule {tag} removed" in log_text(job)

    # The server exits before it ever listens: the rule comes out too.
    (wrapper.parent / "fail").touch()
    job = run(rpc_server_step(deployment, node, lab_host, tag))
    assert job.state == JobState.FAILED and "exited before listening" in job.result, job.result
    assert tag in record.read_text().rsplit("=== start", 1)[1]
    assert tag not in iptables_rules(lab_host), iptables_rules(lab_host)
    assert listeners_in(lab_host, RPC_PORT) == ""


def test_the_documented_sudoers_line_allows_the_consoles_iptables_commands_and_no_other(lab, lab_host):
    require_sudo()
    line = rpc_guard.sudoers_line(PASSWORD_USER, RPC_PORT, iptables_path())
    lab.add_plain_login(lab_host, sudoers=line)
    node = lab_node(lab, lab_host, name="plain-pc", ssh_user=PASSWORD_USER)
    tag = rpc_guard.tag_for(7, node.name)
    rule = rpc_guard.firewall_rule(RPC_PORT, lab_host.host_address, tag)
    others = {
        "sudo -n true": ["sudo", "-n", "true"],
        "flush INPUT": ["sudo", "-n", "iptables", "-w", "-F", "INPUT"],
        "another port (ssh)": rpc_guard.iptables_argv(
            "-I", rpc_guard.firewall_rule(22, lab_host.host_address, tag), sudo=True
        ),
        "ACCEPT instead of REJECT": rpc_guard.iptables_argv(
            "-I", [*rule[: rule.index("-j")], "-j", "ACCEPT"], sudo=True
        ),
        "every source": rpc_guard.iptables_argv(
            "-I", [x if not x.endswith("/32") else "0.0.0.0/0" for x in rule], sudo=True
        ),
        "another chain": ["sudo", "-n", "iptables", "-w", "-I", "OUTPUT", *rule],
    }
    transport = transport_for(node)

    async def session() -> dict:
        async with transport as ssh:
            ctx = SimpleNamespace(transport=ssh)
            outcome = {"uid": (await ssh.run(["id", "-u"])).stdout.strip()}
            outcome["may"] = await may_administer(ctx, rule)
            outcome["insert"] = (await ssh.run(rpc_guard.iptables_argv("-I", rule, sudo=True))).ok
            outcome["chain"] = await asyncio.to_thread(iptables_rules, lab_host)
            outcome["delete"] = (await ssh.run(rpc_guard.iptables_argv("-D", rule, sudo=True))).ok
            outcome["others"] = {name: (await ssh.run(argv)).ok for name, argv in others.items()}
            # Someone who may run `sudo -n true` (what the console used to ask) but not iptables.
            lab.set_sudoers(lab_host, f"{PASSWORD_USER} ALL=(root) NOPASSWD: /usr/bin/true")
            outcome["true_now"] = (await ssh.run(["sudo", "-n", "true"])).ok
            outcome["may_now"] = await may_administer(ctx, rule)
        return outcome

    outcome = asyncio.run(session())
    assert outcome["uid"] == str(PLAIN_UID)
    assert outcome["may"] is True and outcome["insert"] and outcome["delete"], outcome
    assert tag in outcome["chain"], outcome["chain"]
    assert tag not in iptables_rules(lab_host)
    assert not any(outcome["others"].values()), outcome["others"]
    assert outcome["true_now"] and outcome["may_now"] is None, outcome


def user_readable_llamacpp(host) -> tuple[Path, Path]:
    """The cached llama.cpp binaries and their libraries copied where a user who is not root may run them
    (the cache is under root's home), each behind a script that names the copies' folder for the loader
    (the binaries look for their libraries in the cache) and becomes the binary (same PID)."""
    binaries = require_llamacpp()
    folder = host.workdir / "llama-lib"
    shutil.copytree(binaries.rpc_server.parent, folder, symlinks=True)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755)
    scripts = host.workdir / "llama-bin"
    scripts.mkdir()
    out = []
    for binary in (binaries.rpc_server, binaries.llama_server):
        script = scripts / binary.name
        script.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{folder}" exec "{folder / binary.name}" "$@"\n')
        script.chmod(0o755)
        out.append(script)
    scripts.chmod(0o755)
    return out[0], out[1]


@pytest.mark.llamacpp
def test_a_calibration_that_can_neither_tunnel_nor_fence_skips_the_link_and_opens_nothing(
    lab, lab_hosts, settings, tmp_path, monkeypatch
):
    """A user with no sudo rights on a node that allows no tunnels: the devices are measured (on 127.0.0.1),
    the link is not, a third host is refused throughout; with the documented sudoers line the same user's
    calibration measures the link behind the rule, which is gone afterwards."""
    require_sudo()
    settings.VAR_DIR = tmp_path
    node_host, outsider = lab_hosts(2)
    route_between([node_host, outsider])
    lab.add_plain_login(node_host, sudoers="")
    rpc_server, llama_server = user_readable_llamacpp(node_host)
    node = lab_node(lab, node_host, name="plain-pc", ssh_user=PASSWORD_USER, rpc_tunnel=False)
    probe_job = run(Job.objects.create(kind="probe", node=node))
    assert probe_job.state == JobState.SUCCEEDED, probe_job.result
    register_build(node, rpc_server, llama_server)
    seen = watch_rpc_servers(monkeypatch, node_host, outsider)

    job = run(Job.objects.create(kind="calibrate", node=node, title="Calibrate plain-pc"))
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-3000:])
    log = log_text(job)
    assert "link not measured: plain-pc does not allow RPC tunnels" in log, log
    assert "may not run the firewall rule's iptables commands through sudo -n" in log
    print("\n" + "\n".join(line for line in log.splitlines() if line.startswith("link")))
    node.refresh_from_db()
    assert node.link_rtt_ms is None and node.devices.get(name="CPU").measured_overhead_ms is not None
    assert seen and all("127.0.0.1:" in s["listening"] for s in seen), seen
    assert all(node_host.address not in s["listening"] for s in seen), seen
    assert all("REFUSED" in s["outsider"] for s in seen), seen

    seen.clear()
    lab.set_sudoers(node_host, rpc_guard.sudoers_line(PASSWORD_USER, RPC_PORT, iptables_path()))
    job = run(Job.objects.create(kind="calibrate", node=node, title="Calibrate plain-pc"))
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-3000:])
    tag = rpc_guard.calibration_tag(job.pk, node.name)
    log = log_text(job)
    assert f"firewall rule {tag} admits only the console ({node_host.host_address})" in log, log
    print("\n".join(line for line in log.splitlines() if line.startswith("link")))
    node.refresh_from_db()
    assert node.link_rtt_ms > 0 and node.calibration["link_protection"] == "firewall"
    exposed = [s for s in seen if node_host.address in s["listening"]]
    assert len(exposed) == 1 and "REFUSED" in exposed[0]["outsider"], seen
    assert tag not in iptables_rules(node_host) and listeners_in(node_host, RPC_PORT) == ""
