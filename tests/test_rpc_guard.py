"""The pure parts of deployments/rpc_guard.py: bind addresses as rpc-server (inet_aton) reads them, the tunnel
key's restricted entry and its removal (run for real with sh and awk on a file), the tunnel's command line,
and the reaper's view of a tunnel."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest
from django.conf import settings

from deployments import rpc_guard
from deployments.reaper import classify

pytestmark = pytest.mark.security


@pytest.mark.parametrize("value", ["0", "00", "0x0", "0.0.0.0", "0.0", "000.000.000.000"])
def test_every_spelling_of_every_interface_is_refused_unless_allowed(value):
    with pytest.raises(rpc_guard.BindRefused, match="every interface"):
        rpc_guard.normalise_bind(value)
    assert rpc_guard.normalise_bind(value, allow_unspecified=True) == "0.0.0.0"
    assert rpc_guard.binds_everywhere(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("192.168.1.20", "192.168.1.20"),
        ("10.1", "10.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        (" 10.77.1.2 ", "10.77.1.2"),
    ],
)
def test_addresses_are_normalised_as_inet_aton_reads_them(value, expected):
    assert rpc_guard.normalise_bind(value) == expected
    assert not rpc_guard.binds_everywhere(value)


@pytest.mark.parametrize("value", ["::", "[::]", "fd00::5", "::1"])
def test_ipv6_is_refused_with_a_clear_message(value):
    with pytest.raises(rpc_guard.BindRefused, match="IPv4 only"):
        rpc_guard.normalise_bind(value)


def test_a_hostname_is_resolved_to_ipv4():
    def resolve(name, port, family, kind):
        assert (name, family) == ("old-pc.lan", socket.AF_INET)
        return [(socket.AF_INET, kind, 6, "", ("192.168.1.33", 0))]

    assert rpc_guard.normalise_bind("old-pc.lan", resolve=resolve) == "192.168.1.33"

    def nothing(*args):
        raise socket.gaierror("Name or service not known")

    with pytest.raises(rpc_guard.BindRefused, match="does not resolve to an IPv4 address"):
        rpc_guard.normalise_bind("nowhere.lan", resolve=nothing)


def test_the_tunnel_key_may_forward_to_one_port_and_nothing_else():
    private, public = rpc_guard.new_key_pair("ramdeck-d7-old-pc")
    assert private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    line = rpc_guard.authorized_line(public, 50052, "ramdeck-d7-old-pc")
    options, kind, _blob, tag = line.rsplit(" ", 3)
    assert options == (
        'restrict,port-forwarding,pty,permitopen="127.0.0.1:50052",permitlisten="127.0.0.1:50052",'
        'command="sleep 2147483647"'
    )
    assert (kind, tag) == ("ssh-ed25519", "ramdeck-d7-old-pc")


def test_adding_and_removing_a_tagged_key_leaves_every_other_line(tmp_path):
    path = tmp_path / "ssh" / "authorized_keys"
    subprocess.run(rpc_guard.append_line_argv(str(path), "ssh-ed25519 AAAA mine"), check=True)
    line = 'restrict,port-forwarding,permitopen="127.0.0.1:50052" ssh-ed25519 BBBB ramdeck-d7-old-pc'
    subprocess.run(rpc_guard.append_line_argv(str(path), line), check=True)
    subprocess.run(rpc_guard.append_line_argv(str(path), "ssh-ed25519 CCCC ramdeck-d7-old-pc-2"), check=True)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    subprocess.run(rpc_guard.remove_tagged_argv(str(path), "ramdeck-d7-old-pc"), check=True)
    assert path.read_text() == "ssh-ed25519 AAAA mine\nssh-ed25519 CCCC ramdeck-d7-old-pc-2\n"
    subprocess.run(rpc_guard.remove_tagged_argv(str(tmp_path / "missing"), "x"), check=True)


def test_the_reaper_knows_our_tunnel_and_no_other_ssh():
    argv = rpc_guard.forward_argv(
        key_path="/root/.ramdeck/run/d7-ramdeck-rpc-tunnel-old-pc.key",
        known_hosts="/root/.ramdeck/run/d7-ramdeck-rpc-tunnel-old-pc.known_hosts",
        alias="ramdeck-rpc-tunnel-old-pc",
        local_port=50300,
        port=50052,
        user="ramdeck",
        address="10.0.0.5",
        ssh_port=22,
    )
    assert "127.0.0.1:50300:127.0.0.1:50052" in argv and "StrictHostKeyChecking=yes" in argv
    assert classify(" ".join(argv)) == "rpc-tunnel"
    assert classify("ssh -N -L 8080:localhost:80 me@host") is None
    assert classify("/usr/bin/ssh user@host") is None


def test_llama_server_reaches_each_worker_at_its_tunnel_and_the_log_is_read_back():
    args = ["--rpc", "10.0.0.5:50052,10.0.0.6:50052", "--device", "RPC0,RPC1"]
    ends = {"10.0.0.5:50052": "127.0.0.1:50300"}
    assert rpc_guard.tunnel_rpc_args(args, ends)[1] == "127.0.0.1:50300,10.0.0.6:50052"
    log = "load_tensors: RPC0[127.0.0.1:50300] model buffer size = 4.00 MiB"
    assert "RPC0[10.0.0.5:50052]" in rpc_guard.planned_endpoints_in(log, ends)


def test_the_firewall_rule_admits_only_the_coordinator():
    rule = rpc_guard.firewall_rule(50052, "10.0.0.2", "ramdeck-d7-old-pc")
    assert rpc_guard.iptables_argv("-I", rule, sudo=True)[:5] == ["sudo", "-n", "iptables", "-w", "-I"]
    text = " ".join(rule)
    assert "--dport 50052 ! -s 10.0.0.2/32" in text and "--comment ramdeck-d7-old-pc" in text
    assert text.endswith("-j REJECT --reject-with tcp-reset")


def test_the_sudo_check_asks_about_exactly_the_commands_the_console_runs():
    rule = rpc_guard.firewall_rule(50052, "10.0.0.2", "ramdeck-d7-old-pc")
    for action in ("-I", "-D"):
        check = rpc_guard.sudo_allows_argv(action, rule)
        assert check[:3] == ["sudo", "-n", "-l"]  # -l with a command: is it allowed? (runs nothing)
        assert ["sudo", "-n", *check[3:]] == rpc_guard.iptables_argv(action, rule, sudo=True)


def _sudoers_pattern(line: str) -> re.Pattern:
    """The argument pattern of a sudoers line (sudo unescapes `\\!` before it compiles the expression)."""
    return re.compile(line.split(" ^", 1)[1].rstrip("$").replace("\\!", "!"))


@pytest.mark.parametrize("action", ["-I", "-D"])
@pytest.mark.parametrize(
    "tag", [rpc_guard.tag_for(7, "old-pc"), rpc_guard.calibration_tag(12, "old pc.lan"), "ramdeck-x_Y-9"]
)
def test_the_documented_sudoers_line_matches_every_rule_the_console_makes(action, tag):
    line = rpc_guard.sudoers_line("ramdeck", 50052)
    assert line.startswith("ramdeck ALL=(root) NOPASSWD: /usr/sbin/iptables ^-w -[ID] INPUT ")
    for document in ("README.md", "SECURITY.md"):
        assert "sudoers" in (Path(settings.BASE_DIR) / document).read_text()
    assert line in (Path(settings.BASE_DIR) / "README.md").read_text()
    pattern = _sudoers_pattern(line)
    rule = rpc_guard.firewall_rule(50052, "192.168.1.20", tag)
    assert pattern.fullmatch(" ".join(rpc_guard.iptables_argv(action, rule, sudo=False)[1:]))
    other_port = rpc_guard.firewall_rule(22, "192.168.1.20", tag)
    assert not pattern.fullmatch(" ".join(rpc_guard.iptables_argv(action, other_port, sudo=False)[1:]))


def test_a_calibrations_rule_is_tagged_with_its_job_and_node():
    assert rpc_guard.calibration_tag(12, "old pc.lan") == "ramdeck-c12-old_pc_lan"


@pytest.mark.lab
def test_sshd_holds_the_tunnel_key_to_its_one_forward(lab, lab_host, tmp_path):
    """The entry as a real sshd reads it: a local forward to the rpc-server's port is opened, a remote
    forward onto any other port of the worker is refused."""
    private, public = rpc_guard.new_key_pair("ramdeck-d7-old-pc")
    (lab_host.workdir / "authorized_keys").write_text(rpc_guard.authorized_line(public, 50052, "t") + "\n")
    key = tmp_path / "tunnel.key"
    key.write_text(private)
    key.chmod(0o600)
    ssh = ["ssh", "-i", str(key), "-p", str(lab_host.port), "-o", "BatchMode=yes",
           "-o", "ExitOnForwardFailure=yes", "-o", "StrictHostKeyChecking=no",
           "-o", "UserKnownHostsFile=/dev/null"]  # fmt: skip
    target = f"root@{lab_host.address}"
    remote = subprocess.run([*ssh, "-N", "-R", "127.0.0.1:40001:127.0.0.1:22", target],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert remote.returncode != 0 and "remote port forwarding failed" in remote.stderr, remote.stderr
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    forward = f"127.0.0.1:{port}:127.0.0.1:50052"
    local = subprocess.Popen([*ssh, "-tt", "-L", forward, target], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            local.wait(timeout=3)  # the forward is up and the forced command waits
    finally:
        local.kill()
        local.wait()
