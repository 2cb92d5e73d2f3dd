"""The coordinator's RPC client (llamacpp/rpc_reach.py), run here by the real perl against a small server that
answers as ggml-rpc-server does (its HELLO and GET_DEVICE_MEMORY framing, TCP_NODELAY), or refuses, or
hangs up; and the fix commands it names per OS. The real rpc-server meets it in the preflight lab test."""

from __future__ import annotations

import socket
import struct
import subprocess
import threading

import pytest

from llamacpp.rpc_reach import (
    firewall_fix,
    handshakes_argv,
    likely_cause,
    parse_handshakes,
    parse_reach,
    reach_argv,
)


class FakeRpcServer:
    """Answers HELLO with protocol 7.0.0 and GET_DEVICE_MEMORY with 16 bytes; `mute` closes every
    connection without answering (something that is not an rpc-server)."""

    def __init__(self, *, mute: bool = False) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.mute = mute
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if not self.mute:
                    self._answer(conn)

    @staticmethod
    def _read(conn, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _answer(self, conn) -> None:
        while (head := self._read(conn, 9)) is not None:
            cmd, size = struct.unpack("<BQ", head)
            self._read(conn, size)
            if cmd == 14:
                conn.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24))
            elif cmd == 11:
                conn.sendall(struct.pack("<Q", 16) + bytes(16))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server():
    fake = FakeRpcServer()
    yield fake
    fake.close()


def _reach(port: int, **options):
    out = subprocess.run(reach_argv("127.0.0.1", port, **options), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return parse_reach(out.stdout)


def test_the_client_says_hello_and_times_its_requests(server):
    reach = _reach(server.port, pings=4)
    assert reach.ok and reach.protocol == "7.0.0"
    assert len(reach.pings_ms) == 4 and all(0 < t < 1000 for t in reach.pings_ms)
    assert 0 < reach.connect_ms < 1000 and min(reach.pings_ms) <= reach.rtt_ms <= max(reach.pings_ms)


def test_a_perl_without_time_hires_still_checks_the_server_but_times_nothing(server, tmp_path):
    """Debian's bare perl-base has IO::Socket but not Time::HiRes (it comes with the `perl` package)."""
    (tmp_path / "Time").mkdir()
    (tmp_path / "Time" / "HiRes.pm").write_text('die "Time::HiRes is not installed here\\n";\n')
    for argv, parse in (
        (reach_argv("127.0.0.1", server.port), parse_reach),
        (handshakes_argv("127.0.0.1", server.port), parse_handshakes),
    ):
        argv = [argv[0], f"-I{tmp_path}", *argv[1:]]
        reach = parse(subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout)
        assert reach.ok and reach.rtt_ms is None, reach
    assert (
        parse_reach(
            subprocess.run(
                [argv[0], f"-I{tmp_path}", *reach_argv("127.0.0.1", server.port)[1:]],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        ).protocol
        == "7.0.0"
    )


def test_a_closed_port_is_refused_at_connect():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reach = _reach(port)
    assert not reach.ok and reach.stage == "connect" and "refused" in reach.reason.lower()
    assert "rejects the coordinator" in likely_cause(reach, tunnel=False)


def test_something_that_is_not_an_rpc_server_fails_at_hello():
    mute = FakeRpcServer(mute=True)
    try:
        reach = _reach(mute.port)
    finally:
        mute.close()
    assert not reach.ok and reach.stage == "hello"
    assert "not as a ggml-rpc-server" in likely_cause(reach, tunnel=False)
    # Through a tunnel the local end always accepts: a hang-up there means the far side is not reached.
    assert "AllowTcpForwarding" in likely_cause(reach, tunnel=True)


def test_output_that_is_no_answer_is_a_failure_not_a_crash():
    assert not parse_reach("").ok
    assert parse_reach("Can't locate IO/Socket/INET.pm").reason.startswith("Can't locate")
    assert not parse_reach("ok nonsense").ok


@pytest.mark.parametrize(
    ("platform", "tool", "expected"),
    [
        ("linux", "ufw", "sudo ufw allow from 192.168.1.10 to any port 50052 proto tcp"),
        ("linux", "", "sudo ufw allow from 192.168.1.10 to any port 50052 proto tcp"),
        ("linux", "firewall-cmd", "sudo firewall-cmd --permanent --add-rich-rule='rule family=\"ipv4\" "
         "source address=\"192.168.1.10/32\" port port=\"50052\" protocol=\"tcp\" accept' && "
         "sudo firewall-cmd --reload"),
        ("linux", "iptables", "sudo iptables -I INPUT -p tcp -s 192.168.1.10 --dport 50052 -j ACCEPT"),
        ("windows", "", "netsh advfirewall firewall add rule name=\"ggml-rpc-server 50052\" dir=in "
         "action=allow protocol=TCP localport=50052 remoteip=192.168.1.10"),
        ("macos", "", "sudo /usr/libexec/ApplicationFirewall/socketfilterfw "
         "--add '/Users/mia/llama cpp/ggml-rpc-server'"),
    ],
)  # fmt: skip
def test_the_fix_is_the_worker_oss_own_firewall_command(platform, tool, expected):
    fix = firewall_fix(platform, "192.168.1.10", 50052, "/Users/mia/llama cpp/ggml-rpc-server", tool=tool)
    assert fix.startswith(expected)


def test_a_fix_never_carries_anything_but_an_ipv4_address():
    with pytest.raises(ValueError):
        firewall_fix("linux", "10.0.0.1; rm -rf ~", 50052)
