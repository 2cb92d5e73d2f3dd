"""The tunnel key on real machines (issue 17): the `rpc_tunnel` step run by the job runner between two lab
hosts with real sshd, and the stop step that undoes it, without llama.cpp (a small server in the worker's
namespace stands in for ggml-rpc-server: the tunnel only carries bytes).

What it proves: the key's entry names the address the worker sees the coordinator come from (`from=`), and
the key is refused from anywhere else; the worker's `authorized_keys` keeps every line it had (its owner's
last key although the file had no final newline, another console's entry with a similar tag) through install
and removal, and concurrent edits lose no line; the key files reach the coordinator from memory (nothing
appears in the console's temporary folder) with mode 0600.
"""

# ruff: noqa: F811 - the channel_layer fixture is imported from tests/job_fixtures.py and used as a parameter
from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from django.conf import settings

from audit.models import AuditEvent
from deployments.models import Deployment
from jobs.models import Job, JobState
from llamacpp import rpc_guard
from modelfiles.models import ModelFile
from remote.ssh import SSHTarget, SSHTransport
from tests.deploy_fixtures import lab_node, log_text, pid_alive, route_between, run, start_in
from tests.job_fixtures import channel_layer  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.lab,
    pytest.mark.security,
    pytest.mark.timeout(300),
    pytest.mark.django_db(transaction=True),
]

PORT = 50052
# Answers every connection with one line, as a stand-in for the worker's rpc-server on 127.0.0.1.
SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(b"rpc-server here\\n")
    c.close()
"""
# Connects to 127.0.0.1:PORT in the namespace it runs in and prints what it read.
CLIENT = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), 5) as c:
    print(c.recv(100).decode().strip())
"""


@pytest.fixture
def pair(lab, lab_hosts, tmp_path, channel_layer):
    coordinator_host, worker_host = lab_hosts(2)
    route_between([coordinator_host, worker_host])
    coordinator = lab_node(lab, coordinator_host, name="desk", may_coordinate=True)
    worker = lab_node(lab, worker_host, name="old-pc")
    start_in(worker_host, [sys.executable, "-c", SERVER, str(PORT)], tmp_path / "server.log")
    model = ModelFile.objects.create(name="tiny", node=coordinator, path="/m/tiny.gguf")
    deployment = Deployment.objects.create(
        name="tiny", model_file=model, coordinator=coordinator, plan={}, port=8080
    )
    return coordinator_host, worker_host, coordinator, worker, deployment


def _tunnel_step(deployment, coordinator, worker) -> Job:
    return run(
        Job.objects.create(
            kind="rpc_tunnel",
            node=coordinator,
            title="tunnel",
            params={
                "deployment": deployment.pk,
                "worker": worker.pk,
                "port": PORT,
                "endpoint": f"{worker.address}:{PORT}",
            },
        )
    )


def _stop_step(deployment, node, *, processes=(), guards=()) -> Job:
    params = {"deployment": deployment.pk, "processes": list(processes), "guards": list(guards)}
    return run(Job.objects.create(kind="stop", node=node, title="stop", params=params))


def _read_through(host, port: int) -> str:
    result = subprocess.run(
        host.exec_argv([sys.executable, "-c", CLIENT, str(port)]), capture_output=True, text=True, timeout=30
    )
    return result.stdout.strip() or result.stderr.strip()


def _console_logs_in(lab, host) -> bool:
    async def check() -> bool:
        target = SSHTarget(
            host=host.address, private_key=lab.client_private_key, pinned_host_key=host.host_public_key
        )
        async with SSHTransport(target) as ssh:
            return (await ssh.run(["true"])).ok

    return asyncio.run(check())


def test_the_tunnel_key_comes_from_the_coordinator_and_its_removal_leaves_every_other_line(
    lab, pair, tmp_path, monkeypatch
):
    coordinator_host, worker_host, coordinator, worker, deployment = pair
    authorized = worker_host.workdir / "authorized_keys"
    # The owner's file: another console's tunnel entry for a deployment with the same number on a node of the
    # same name, an entry in the old tag format, and the owner's own key last, without a final newline.
    other = (
        f'restrict,permitopen="127.0.0.1:{PORT}" ssh-ed25519 AAAAother ramdeck-0ther-d{deployment.pk}-old-pc'
    )
    older = f"restrict ssh-ed25519 AAAAolder ramdeck-d{deployment.pk}-old-pc"
    owner = lab.client_public_key.strip()
    authorized.write_text(f"{other}\n{older}\n{owner}")

    # Nothing passes through the console's temporary folder: the key files go from memory to the node.
    console_tmp = tmp_path / "console-tmp"
    console_tmp.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(console_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(console_tmp))
    during = []
    for name in ("upload", "write_file"):
        original = getattr(SSHTransport, name)

        async def watched(self, *args, _original=original, **kwargs):
            during.append(sorted(p.name for p in console_tmp.iterdir()))
            return await _original(self, *args, **kwargs)

        monkeypatch.setattr(SSHTransport, name, watched)

    job = _tunnel_step(deployment, coordinator, worker)
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-3000:])
    assert during == [[], []] and list(console_tmp.iterdir()) == []  # the private key, the known host
    deployment.refresh_from_db()
    tunnel = deployment.processes["rpc-tunnel@old-pc"]
    assert tunnel["node"] == "desk" and pid_alive(int(tunnel["pid"]))
    for path in (tunnel["key_file"], *tunnel["files"]):
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600, path

    # The entry: from the coordinator's address on the lab network (not the console's view of it), with this
    # console's id in its tag; the discovery entry is gone again.
    tag = rpc_guard.tag_for(deployment.pk, "old-pc", settings.RAMDECK_CONSOLE_ID)
    assert settings.RAMDECK_CONSOLE_ID in tag
    lines = authorized.read_text().splitlines()
    assert lines[:3] == [other, older, owner]
    (entry,) = [line for line in lines if line.endswith(tag)]
    assert entry.startswith(f'restrict,from="{coordinator_host.address}",port-forwarding,pty,')
    assert rpc_guard.DISCOVERY_MARK not in authorized.read_text()
    guard = deployment.guards["authorized-key@old-pc"]
    assert guard["lines"][-1] == entry and guard["path"] == str(authorized)
    text = log_text(job)
    assert f"old-pc sees desk come from {coordinator_host.address}" in text
    # A stock sshd lets a login make Unix-socket forwards: said loudly, and in the history.
    assert "WARNING: old-pc's sshd allows Unix-socket forwarding" in text
    assert AuditEvent.objects.filter(action="deployment.tunnel_unix_forwards", changes__sshd="open").exists()

    # The tunnel carries bytes from the coordinator's loopback to the worker's.
    assert _read_through(coordinator_host, int(tunnel["port"])) == "rpc-server here"
    # The same key from anywhere else (this machine's side of the worker's link) is refused.
    elsewhere = subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", tunnel["key_file"],
         "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-N", f"root@{worker_host.address}"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert elsewhere.returncode == 255 and "Permission denied" in elsewhere.stderr, elsewhere.stderr

    # Stop: the coordinator's tunnel ends, the worker's file is what it was (plus the owner's newline).
    stop = _stop_step(deployment, coordinator, processes=[tunnel])
    assert stop.state == JobState.SUCCEEDED, (stop.result, log_text(stop))
    stop = _stop_step(deployment, worker, guards=[guard])
    assert stop.state == JobState.SUCCEEDED, (stop.result, log_text(stop))
    assert not pid_alive(int(tunnel["pid"]))
    assert authorized.read_text() == f"{other}\n{older}\n{owner}\n"
    assert _console_logs_in(lab, worker_host)  # the owner's last key still lets the console in
    assert list(console_tmp.iterdir()) == []


def test_concurrent_edits_of_a_real_authorized_keys_file_lose_no_line(lab, lab_host):
    """Installs and removals at once over one SSH connection (two consoles, a heal and a stop on one node);
    sshd still lets the owner in afterwards."""
    authorized = lab_host.workdir / "authorized_keys"
    owner = lab.client_public_key.strip()
    old = [f"restrict ssh-ed25519 OLD{i} ramdeck-c0ffee-d{i}-w" for i in range(15)]
    new = [f"restrict ssh-ed25519 NEW{i} ramdeck-c0ffee-d{100 + i}-w" for i in range(15)]
    authorized.write_text("".join(f"{line}\n" for line in old) + owner)  # no final newline

    async def edit_all() -> list[bool]:
        target = SSHTarget(
            host=lab_host.address,
            private_key=lab.client_private_key,
            pinned_host_key=lab_host.host_public_key,
        )
        async with SSHTransport(target) as ssh:
            argvs = [rpc_guard.edit_lines_argv(str(authorized), add=line) for line in new]
            argvs += [rpc_guard.edit_lines_argv(str(authorized), remove=line) for line in old]
            results = await asyncio.gather(*(ssh.run(argv, timeout=120) for argv in argvs))
        return [result.ok for result in results]

    started = time.monotonic()
    assert all(asyncio.run(edit_all()))
    assert sorted(authorized.read_text().splitlines()) == sorted([owner, *new])
    assert _console_logs_in(lab, lab_host)
    print(f"\nTUNNEL-KEY-EDITS 30 concurrent edits in {time.monotonic() - started:.2f} s")


def test_a_worker_whose_sshd_reads_another_file_fails_the_step_with_the_reason_and_leaves_nothing(lab, pair):
    """The node setting names a file the worker's sshd does not read: the coordinator's discovery login is
    refused, the step says so and what to check, and neither the entry nor the key files stay behind."""
    _, worker_host, coordinator, worker, deployment = pair
    elsewhere = worker_host.workdir / "not_read_by_sshd"
    elsewhere.write_text("ssh-ed25519 AAAAowner me@laptop\n")
    worker.authorized_keys_path = str(elsewhere)
    worker.save(update_fields=["authorized_keys_path"])
    job = _tunnel_step(deployment, coordinator, worker)
    assert job.state == JobState.FAILED, job.result
    assert job.result.startswith("desk could not log in to old-pc with the tunnel key")
    assert "Permission denied" in job.result
    assert "Does the worker's node setting name the authorized_keys file its sshd reads?" in job.result
    assert elsewhere.read_text() == "ssh-ed25519 AAAAowner me@laptop\n"
    deployment.refresh_from_db()
    assert deployment.processes == {}
    assert not list(Path.home().glob(f".ramdeck/run/d{deployment.pk}-ramdeck-rpc-tunnel-old-pc.*"))
