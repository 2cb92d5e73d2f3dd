"""The pure parts of llamacpp/rpc_guard.py: bind addresses as rpc-server (inet_aton) reads them, the tunnel
key's restricted entry and its removal (run for real with sh and awk on a file), the tunnel's command line,
and the reaper's view of a tunnel."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from django.conf import settings

from llamacpp import rpc_guard
from llamacpp.reaper import classify

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
    private, public = rpc_guard.new_key_pair("ramdeck-c0ffee-d7-old-pc")
    assert private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    line = rpc_guard.authorized_line(public, 50052, "ramdeck-c0ffee-d7-old-pc", "10.0.0.2")
    options, kind, _blob, tag = line.rsplit(" ", 3)
    assert options == (
        'restrict,from="10.0.0.2",port-forwarding,pty,permitopen="127.0.0.1:50052",'
        'permitlisten="127.0.0.1:50052",command="sleep 2147483647"'
    )
    assert (kind, tag) == ("ssh-ed25519", "ramdeck-c0ffee-d7-old-pc")
    first = rpc_guard.discovery_line(public, tag)
    assert first.startswith('restrict,command="echo ramdeck-source $SSH_CLIENT" ssh-ed25519 ')
    assert "port-forwarding" not in first and "pty" not in first


@pytest.mark.parametrize("source", ["old-pc.lan", "10.0.0.*", "10.0.0.0/24", "", "10.0.0.2,10.0.0.3", "!x"])
def test_from_names_one_ip_address_never_a_name_or_a_pattern(source):
    _, public = rpc_guard.new_key_pair("t")
    with pytest.raises(ValueError, match="not an IP address"):
        rpc_guard.authorized_line(public, 50052, "t", source)


def test_from_is_written_as_sshd_reports_the_client():
    assert rpc_guard.source_pattern("::ffff:10.0.0.2") == "10.0.0.2"
    assert rpc_guard.source_pattern("fd00:0::5") == "fd00::5"
    assert rpc_guard.parse_source("banner\nramdeck-source 10.77.3.2 40022 22\n") == "10.77.3.2"
    assert rpc_guard.parse_source("ramdeck-source fd00::5 40022 22") == "fd00::5"
    assert rpc_guard.parse_source("Permission denied (publickey).") is None
    assert rpc_guard.parse_source("ramdeck-source not-an-address 1 2") is None


def test_the_tag_carries_the_consoles_id():
    assert rpc_guard.tag_for(7, "old pc", "c0ffee") == "ramdeck-c0ffee-d7-old_pc"
    assert rpc_guard.tag_for(7, "old pc") == "ramdeck-d7-old_pc"


def _edit(path, *, remove="", add="", env=None):
    return subprocess.run(
        rpc_guard.edit_lines_argv(str(path), remove=remove, add=add),
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_adding_and_removing_a_line_leaves_every_other_line_exactly(tmp_path):
    path = tmp_path / "ssh" / "authorized_keys"
    ours = 'restrict,from="10.0.0.2",port-forwarding ssh-ed25519 BBBB ramdeck-c0ffee-d7-old-pc'
    for line in ("ssh-ed25519 AAAA mine", ours, "ssh-ed25519 CCCC ramdeck-c0ffee-d7-old-pc"):
        assert _edit(path, add=line).returncode == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert _edit(path, add=ours).returncode == 0  # a retried step does not add it twice
    assert path.read_text().count(ours) == 1
    assert _edit(path, remove=ours).returncode == 0
    # The other line with the same tag is another key (another console's, or the owner's): it stays.
    assert path.read_text() == "ssh-ed25519 AAAA mine\nssh-ed25519 CCCC ramdeck-c0ffee-d7-old-pc\n"
    assert _edit(path, remove=ours).returncode == 0  # already gone: fine
    assert _edit(tmp_path / "missing", remove=ours).returncode == 0
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ValueError, match="one line"):
        rpc_guard.edit_lines_argv(str(path), add="a\nb")


def test_a_file_without_its_final_newline_keeps_its_last_line(tmp_path):
    """The old append ran the tunnel key into the owner's last line, and the removal took both."""
    path = tmp_path / "authorized_keys"
    path.write_text("ssh-ed25519 AAAA me@laptop\nssh-ed25519 DDDD me@phone")
    ours = 'restrict,from="10.0.0.2" ssh-ed25519 BBBB ramdeck-c0ffee-d7-old-pc'
    assert _edit(path, add=ours).returncode == 0
    assert path.read_text().splitlines() == ["ssh-ed25519 AAAA me@laptop", "ssh-ed25519 DDDD me@phone", ours]
    assert _edit(path, remove=ours).returncode == 0
    assert path.read_text() == "ssh-ed25519 AAAA me@laptop\nssh-ed25519 DDDD me@phone\n"


def test_a_guard_of_an_older_console_is_still_removed_by_its_tag(tmp_path):
    path = tmp_path / "authorized_keys"
    path.write_text("ssh-ed25519 AAAA mine\nrestrict ssh-ed25519 BBBB ramdeck-d7-old-pc\n")
    subprocess.run(rpc_guard.remove_tagged_argv(str(path), "ramdeck-d7-old-pc"), check=True)
    assert path.read_text() == "ssh-ed25519 AAAA mine\n"
    subprocess.run(rpc_guard.remove_tagged_argv(str(tmp_path / "missing"), "x"), check=True)


def _path_without_flock(tmp_path):
    """A PATH with the tools the script uses but no flock(1), as on macOS."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("sh", "mkdir", "rmdir", "dirname", "grep", "awk", "cat", "rm", "tail", "sleep"):
        found = shutil.which(tool)
        if found:
            (folder / tool).symlink_to(found)
    return {"PATH": str(folder)}


def test_a_lock_folder_left_by_a_process_that_is_gone_is_taken_over(tmp_path):
    """Where there is no flock(1): an edit killed while it held the lock folder does not block the next."""
    path = tmp_path / "authorized_keys"
    path.write_text("ssh-ed25519 AAAA owner\n")
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / "authorized_keys.ramdeck-lock"
    stale.mkdir()
    (stale / "pid").write_text(f"{gone.pid}\n")
    result = _edit(path, add="restrict ssh-ed25519 BBBB t", env=_path_without_flock(tmp_path))
    assert result.returncode == 0, result.stderr
    assert path.read_text() == "ssh-ed25519 AAAA owner\nrestrict ssh-ed25519 BBBB t\n"
    assert not stale.exists() and not (tmp_path / "authorized_keys.ramdeck-lock.break").exists()


@pytest.mark.parametrize("lock", ["flock", "lock folder"])
def test_concurrent_edits_lose_no_line(tmp_path, lock):
    """Twenty adds and twenty removes at once (two consoles, a heal, a stop): no edit loses another's."""
    env = None if lock == "flock" else _path_without_flock(tmp_path)
    if lock == "flock":
        assert shutil.which("flock"), "flock(1) is part of util-linux on every Linux this runs on"
    path = tmp_path / "authorized_keys"
    old = [f"restrict ssh-ed25519 OLD{i} ramdeck-c0ffee-d{i}-w" for i in range(20)]
    new = [f"restrict ssh-ed25519 NEW{i} ramdeck-c0ffee-d{100 + i}-w" for i in range(20)]
    path.write_text("ssh-ed25519 AAAA owner\n" + "".join(f"{line}\n" for line in old))
    argvs = [rpc_guard.edit_lines_argv(str(path), remove=line) for line in old]
    argvs += [rpc_guard.edit_lines_argv(str(path), add=line) for line in new]
    random.Random(7).shuffle(argvs)
    procs = [subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) for argv in argvs]
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), errors
    assert sorted(path.read_text().splitlines()) == sorted(["ssh-ed25519 AAAA owner", *new])
    assert not (tmp_path / "authorized_keys.ramdeck-lock").exists()


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


def test_experts_placed_on_a_worker_are_named_by_its_tunnel_end_too():
    # llama.cpp names an RPC buffer after the endpoint --rpc gave it: an -ot rule naming the planned
    # endpoint would be refused ("unknown buffer type") once --rpc names the tunnel's local end.
    rule = r"blk\.(4|5)\.ffn_(up|down|gate|gate_up)_(ch|)exps=RPC0[10.0.0.5:50052]"
    other = r"blk\.(0)\.ffn_(up|down|gate|gate_up)_(ch|)exps=RPC0[10.0.0.6:50052]"
    args = ["--rpc", "10.0.0.5:50052,10.0.0.6:50052", "-ot", rule, "-ot", other]
    tunneled = rpc_guard.tunnel_rpc_args(args, {"10.0.0.5:50052": "127.0.0.1:50300"})
    assert tunneled[3].endswith("=RPC0[127.0.0.1:50300]") and tunneled[5] == other
    assert args[3] == rule  # the plan's own arguments are left as they were


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


def _ssh(key, host) -> list[str]:
    return ["ssh", "-F", "/dev/null", "-i", str(key), "-p", str(host.port), "-o", "BatchMode=yes",
            "-o", "ExitOnForwardFailure=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-l", "root", host.address]  # fmt: skip


def _stays_up(argv: list[str], seconds: float = 3) -> bool:
    """True when `ssh` is still running after `seconds` (its forwards are up), False when it exited."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _unix_forward_granted(key, host, path) -> bool:
    """Whether sshd lets the key make it listen on the Unix socket `path` (`ssh -R path:127.0.0.1:PORT`)."""
    argv = [*_ssh(key, host), "-N", "-R", f"{path}:127.0.0.1:50052"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None and not path.exists():
            time.sleep(0.05)
        return path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        path.unlink(missing_ok=True)


def _console_says(lab, host) -> str:
    """What the tunnel step reports about the worker's sshd (deployments/rpc_tunnel_step.unix_forwards)."""
    from deployments.steps.rpc_tunnel import unix_forwards
    from remote.ssh import SSHTarget, SSHTransport

    async def ask() -> str:
        target = SSHTarget(
            host=host.address, private_key=lab.client_private_key, pinned_host_key=host.host_public_key
        )
        async with SSHTransport(target) as ssh:
            return await unix_forwards(ssh)

    return asyncio.run(ask())


@pytest.mark.lab
def test_sshd_holds_the_tunnel_key_to_its_one_forward(lab, lab_host, tmp_path):
    """The entry as a real sshd (OpenSSH 9.2) reads it. From the coordinator's address (here the test's own
    side of the lab link) a local forward to the rpc-server's port is opened; from any other address the key
    is refused; a remote forward onto any other port and a local forward onto a Unix socket of the worker
    are refused. A remote forward onto a Unix socket is refused by no key option (permitlisten does not
    apply to it): a stock sshd grants it and the console says so; with `AllowStreamLocalForwarding no` in
    sshd_config it is refused, the tunnel still works and the console says that."""
    private, public = rpc_guard.new_key_pair("ramdeck-c0ffee-d7-old-pc")
    authorized = lab_host.workdir / "authorized_keys"
    owner = authorized.read_text()
    line = rpc_guard.authorized_line(public, 50052, "t", lab_host.host_address)
    authorized.write_text(owner + line + "\n")
    key = tmp_path / "tunnel.key"
    key.write_text(private)
    key.chmod(0o600)
    ssh = _ssh(key, lab_host)

    remote = subprocess.run([*ssh, "-N", "-R", "127.0.0.1:40001:127.0.0.1:22"],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert remote.returncode != 0 and "remote port forwarding failed" in remote.stderr, remote.stderr

    # -L onto a Unix socket of the worker: permitopen applies, the channel is refused, nothing connects.
    socket_path = tmp_path / "service.sock"
    with socket.socket(socket.AF_UNIX) as service:
        service.bind(str(socket_path))
        service.listen()
        service.settimeout(3)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        proc = subprocess.Popen([*ssh, "-N", "-L", f"127.0.0.1:{port}:{socket_path}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as c:
                    c.settimeout(3)
                    assert c.recv(1) == b""  # sshd refused the channel: the client closes the connection
                    break
                assert time.monotonic() < deadline, "the local end never listened"
                time.sleep(0.1)
            with pytest.raises(TimeoutError):
                service.accept()
        finally:
            proc.kill()
            _, err = proc.communicate()
    assert "open failed" in err, err

    # The one forward works from the coordinator's address, and only from there.
    tunnel = [*ssh, "-tt", "-L", f"127.0.0.1:{port}:127.0.0.1:50052"]
    assert _stays_up(tunnel)
    authorized.write_text(owner + rpc_guard.authorized_line(public, 50052, "t", "10.77.254.254") + "\n")
    elsewhere = subprocess.run([*ssh, "-N"], capture_output=True, text=True, timeout=30)
    assert elsewhere.returncode == 255 and "Permission denied" in elsewhere.stderr, elsewhere.stderr
    authorized.write_text(owner + line + "\n")

    # -R onto a Unix socket: a stock sshd grants it, whatever the key says. The console notices.
    assert _unix_forward_granted(key, lab_host, tmp_path / "x.sock")
    assert _console_says(lab, lab_host) == "open"

    # The documented setting refuses it; the tunnel still works.
    lab.start_sshd(lab_host, extra_config=["AllowStreamLocalForwarding no"])
    authorized.write_text(owner + line + "\n")
    assert not _unix_forward_granted(key, lab_host, tmp_path / "x.sock")
    refused = subprocess.run([*ssh, "-N", "-R", f"{tmp_path / 'x.sock'}:127.0.0.1:50052"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert "remote port forwarding failed for listen path" in refused.stderr, refused.stderr
    assert _stays_up(tunnel)
    assert _console_says(lab, lab_host) == "refused"
    assert not list(Path("/tmp").glob("ramdeck-rpc-tunnel-probe-*"))  # the probe leaves no socket behind
