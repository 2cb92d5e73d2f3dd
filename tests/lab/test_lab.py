"""The network-namespace lab itself: what it builds, and that it leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from remote.ssh import SSHTarget, SSHTransport
from tests.lab import fixtures, netlab

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]


def netns_names() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def dead_pid() -> int:
    """A PID that belonged to a process which has exited (as a crashed test run's would)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def target(lab, host) -> SSHTarget:
    return SSHTarget(
        host=host.address,
        private_key=lab.client_private_key,
        pinned_host_key=host.host_public_key,
        connect_timeout=3,
    )


def test_each_host_has_its_own_address_and_sshd(lab_hosts):
    first, second = lab_hosts(2)
    assert first.address != second.address
    assert first.address.startswith("10.77.") and first.address.endswith(".2")
    assert first.host_address == first.address.rsplit(".", 1)[0] + ".1"
    assert first.host_public_key != second.host_public_key
    inside = subprocess.run(
        first.exec_argv(["ip", "-4", "-o", "addr"]), capture_output=True, text=True
    ).stdout
    assert first.address in inside and second.address not in inside


async def test_teardown_ends_every_process_and_removes_every_trace(tmp_path):
    lab = netlab.Lab()
    try:
        host = lab.add_host()
        lab.throttle_cpu(host, 0.5)
        async with SSHTransport(target(lab, host)) as ssh:
            daemon = await ssh.start_daemon(["sleep", "600"], log_path=str(host.workdir / "d.log"))
        sshd = host.sshd_pid
        assert netlab._pid_alive(daemon) and netlab._pid_alive(sshd)
    finally:
        lab.close()
    assert host.netns not in netns_names()
    assert not link_exists(host.veth_host)
    assert not netlab._pid_alive(daemon) and not netlab._pid_alive(sshd)
    assert not (netlab.CGROUP_CPU_ROOT / host.netns).exists()
    assert not (netlab.NETNS_ETC / host.netns).exists()
    assert not lab.workdir.exists()


async def test_a_throttled_host_runs_what_sshd_starts_in_its_cpu_cgroup(lab, lab_host):
    group = lab.throttle_cpu(lab_host, 0.1)
    assert (group / "cpu.cfs_quota_us").read_text().strip() == "10000"
    assert (group / "cpu.cfs_period_us").read_text().strip() == "100000"
    async with SSHTransport(target(lab, lab_host)) as ssh:
        result = await ssh.run(["cat", "/proc/self/cgroup"])
    cpu_line = next(line.text for line in result.lines if ":cpu:" in line.text or ":cpu," in line.text)
    assert cpu_line.endswith(f"/{lab_host.netns}")
    # A short period makes the same share a steady slowdown; the kernel's smallest quota is 1 ms.
    lab.throttle_cpu(lab_host, 0.05, period_us=10_000)
    assert (group / "cpu.cfs_quota_us").read_text().strip() == "1000"
    assert (group / "cpu.cfs_period_us").read_text().strip() == "20000"


def test_leftovers_of_a_crashed_run_are_removed_and_a_live_runs_are_not(lab_host):
    pid = dead_pid()
    netns, veth = f"{netlab.PREFIX}-{pid}-0", f"{netlab.VETH_PREFIX}{pid}h0"
    stale_dir = Path(f"/tmp/{netlab.PREFIX}-{pid}-crashed")
    subprocess.run(["ip", "netns", "add", netns], check=True)
    subprocess.run(
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{netlab.VETH_PREFIX}{pid}n0"]
    )
    (netlab.CGROUP_CPU_ROOT / netns).mkdir()
    stale_dir.mkdir()
    try:
        removed = netlab.cleanup_leftovers()
    finally:
        # Should the code under test fail, do not leave the simulated crash behind either.
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        if (netlab.CGROUP_CPU_ROOT / netns).exists():
            (netlab.CGROUP_CPU_ROOT / netns).rmdir()
    assert netns in removed and veth in removed and str(stale_dir) in removed
    assert not stale_dir.exists()
    assert lab_host.netns in netns_names()  # This (live) run's host is untouched.
    assert link_exists(lab_host.veth_host)


def test_without_the_lab_a_test_is_skipped_but_under_ci_it_fails(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        fixtures._cannot_run("the network-namespace lab needs root")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        fixtures._cannot_run("the network-namespace lab needs root")


def test_the_lab_says_why_it_cannot_run(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netlab.unavailable_reason() == "the network-namespace lab needs root"
    with pytest.raises(netlab.LabUnavailable):
        netlab.Lab()


def forward_rules() -> str:
    return subprocess.run(["iptables", "-w", "-S", "FORWARD"], capture_output=True, text=True).stdout


def test_routed_hosts_reach_each_other_past_a_dropping_forward_chain_and_the_rules_go_with_the_lab(lab):
    """dockerd sets the FORWARD policy to DROP; a DROP rule for just these two hosts, appended after the
    lab's rules, stands in for it here without touching anyone else's traffic."""
    from tests.deploy_fixtures import route_between

    first, second = lab.add_host(), lab.add_host()
    route_between([first, second])
    tag = f"--comment {netlab.PREFIX}-{os.getpid()}"
    assert forward_rules().count(tag) == 2
    dropping = ["FORWARD", "-s", first.address, "-d", second.address, "-j", "DROP"]
    subprocess.run(["iptables", "-w", "-A", *dropping], check=True)
    try:
        greeting = subprocess.run(
            first.exec_argv(
                [
                    "python3",
                    "-c",
                    f"import socket; print(socket.create_connection(('{second.address}', 22), 5).recv(4))",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        subprocess.run(["iptables", "-w", "-D", *dropping], check=True)
    assert greeting.stdout.strip() == "b'SSH-'", greeting.stderr
    lab.close()
    assert tag not in forward_rules()


def test_forward_rules_of_a_crashed_run_are_removed():
    pid = dead_pid()
    for rule in netlab._forward_rules(pid):
        subprocess.run(["iptables", "-w", "-I", "FORWARD", *rule], check=True)
    removed = netlab.cleanup_leftovers()
    assert f"iptables FORWARD rules of {netlab.PREFIX}-{pid}" in removed
    assert f"--comment {netlab.PREFIX}-{pid}" not in forward_rules()


MIB = 2**20


async def test_a_memory_limited_host_reports_its_limit_as_its_ram_and_enforces_it(lab, lab_host):
    from nodes.probe.collect import collect

    group = lab.limit_memory(lab_host, 512 * MIB)
    inside = subprocess.run(
        lab_host.limited_argv(["cat", "/proc/self/cgroup"]), capture_output=True, text=True
    )
    assert f":memory:/{group.relative_to(netlab.CGROUP_MEMORY_MOUNT)}\n" in inside.stdout
    async with SSHTransport(target(lab, lab_host)) as ssh:
        report = await collect(ssh, "auto", rpc_port=50052)
        # Touching 800 MiB goes past the limit: the kernel ends the process, as on a small machine.
        hog = "b = bytearray(800 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1"
        result = await ssh.run(["python3", "-c", hog], timeout=120)
    assert report.memory_limit_bytes == 512 * MIB
    [cpu] = report.devices
    assert cpu.total_bytes == 512 * MIB and 0 < cpu.free_bytes <= 512 * MIB
    assert result.exit_status != 0
    lab.close()
    assert not group.exists()


@pytest.mark.llamacpp
async def test_a_rate_limited_link_shows_in_the_rpc_throughput(lab, lab_host):
    from llamacpp.rpc_wire import measure_link
    from tests.deploy_fixtures import wait_listening
    from tests.llamacpp_build import require_llamacpp

    rpc_server = require_llamacpp().rpc_server
    argv = [str(rpc_server), "-H", lab_host.address, "-p", "50052"]
    server = subprocess.Popen(
        lab_host.limited_argv(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    lab_host.extra_pids.append(server.pid)
    wait_listening(lab_host, 50052)
    free = await measure_link(lab_host.address, 50052, transfer_bytes=8 * MIB)
    lab.limit_link(lab_host, 40)  # 40 Mbit/s: 5 MB/s
    limited = await measure_link(lab_host.address, 50052, transfer_bytes=8 * MIB)
    lab.unlimit_link(lab_host)
    assert limited.throughput_mbs <= 6.0
    assert free.throughput_mbs > 4 * limited.throughput_mbs
    assert limited.rtt_ms is not None and limited.protocol == "7.0.0"
