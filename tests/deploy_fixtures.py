"""Helpers for the lifecycle tests on the lab: nodes for lab hosts, processes in a host, who holds a port."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from jobs.models import Job
from nodes.models import CredentialKind, Node
from tests.factories import CredentialFactory, NodeFactory
from tests.lab.netlab import kill_pid
from tests.llamacpp_build import require_llamacpp


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
    from jobs.runner import run_job

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
