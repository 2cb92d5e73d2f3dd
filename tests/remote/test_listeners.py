"""Reading listener tables of three platforms (remote/listeners.py), shared by the probe and the reaper.

The samples are recorded outputs of the real tools (ss and lsof on Debian, lsof on macOS 14, PowerShell 7
on Windows 11).
"""

from __future__ import annotations

import pytest

from remote.listeners import (
    Listener,
    holders_of,
    parse_get_nettcpconnection,
    parse_lsof,
    parse_ss,
    redact_cmdline,
)

SS_WITH_HEADER = """\
State  Recv-Q Send-Q Local Address:Port  Peer Address:PortProcess
LISTEN 0      5          127.0.0.1:18765      0.0.0.0:*    users:(("python3",pid=23168,fd=3))
LISTEN 0      511        10.77.1.2:50052      0.0.0.0:*    users:(("ggml-rpc-server",pid=4242,fd=3))
LISTEN 0      511            [::1]:6379          [::]:*    users:(("redis-server",pid=2210,fd=7))
LISTEN 0      128          0.0.0.0:2024       0.0.0.0:*
"""

SS_NO_HEADER_TWO_SOCKETS = """\
LISTEN 0      511        127.0.0.1:6379  0.0.0.0:* users:(("redis-server",pid=2210,fd=6))
LISTEN 0      511            [::1]:6379     [::]:* users:(("redis-server",pid=2210,fd=7))
"""

SS_FORKED_SHARED_SOCKET = """\
LISTEN 0 128 0.0.0.0:8080 0.0.0.0:* users:(("llama-server",pid=900,fd=5),("llama-server",pid=901,fd=5))
"""

LSOF_LINUX = """\
COMMAND   PID USER   FD   TYPE DEVICE SIZE/OFF NODE NAME
python3 23168 root    3u  IPv4  73243      0t0  TCP 127.0.0.1:18765 (LISTEN)
"""

LSOF_MACOS = """\
COMMAND     PID   USER   FD   TYPE             DEVICE SIZE/OFF NODE NAME
rpc-serve 81234 leonie    3u  IPv4 0x5f0c2a3b4c5d6e7f      0t0  TCP 192.168.1.102:50052 (LISTEN)
rpc-serve 81234 leonie    4u  IPv6 0x5f0c2a3b4c5d6e80      0t0  TCP [::1]:50052 (LISTEN)
"""

WINDOWS_ONE = """\
{
  "LocalAddress": "0.0.0.0",
  "LocalPort": 50052,
  "OwningProcess": 7312
}
"""

WINDOWS_MANY = """\
[
  {"LocalAddress": "0.0.0.0", "LocalPort": 8080, "OwningProcess": 5120},
  {"LocalAddress": "::", "LocalPort": 8080, "OwningProcess": 5120}
]
"""


def test_ss_output_with_header_gives_every_listener_with_pid_and_name():
    listeners = parse_ss(SS_WITH_HEADER)
    assert Listener("127.0.0.1", 18765, 23168, "python3") in listeners
    assert Listener("10.77.1.2", 50052, 4242, "ggml-rpc-server") in listeners
    assert Listener("::1", 6379, 2210, "redis-server") in listeners


def test_ss_listener_of_another_user_has_no_pid():
    assert Listener("0.0.0.0", 2024, None, "") in parse_ss(SS_WITH_HEADER)


def test_one_process_on_ipv4_and_ipv6_counts_once_as_holder():
    holders = holders_of(parse_ss(SS_NO_HEADER_TWO_SOCKETS), 6379)
    assert [h.pid for h in holders] == [2210]


def test_a_socket_shared_by_two_processes_names_both():
    holders = holders_of(parse_ss(SS_FORKED_SHARED_SOCKET), 8080)
    assert sorted(h.pid for h in holders) == [900, 901]


def test_holders_of_another_port_is_empty():
    assert holders_of(parse_ss(SS_WITH_HEADER), 50053) == []


def test_lsof_on_linux_and_macos():
    assert parse_lsof(LSOF_LINUX) == [Listener("127.0.0.1", 18765, 23168, "python3")]
    mac = holders_of(parse_lsof(LSOF_MACOS), 50052)
    assert [(h.pid, h.name) for h in mac] == [(81234, "rpc-serve")]


def test_get_nettcpconnection_single_object_and_list():
    assert parse_get_nettcpconnection(WINDOWS_ONE) == [Listener("0.0.0.0", 50052, 7312)]
    assert [h.pid for h in holders_of(parse_get_nettcpconnection(WINDOWS_MANY), 8080)] == [5120]
    assert parse_get_nettcpconnection("") == []


def test_ss_without_header_on_ipv6_and_without_process_info():
    text = (
        'LISTEN 0 1 [::]:50052 [::]:* users:(("ggml-rpc-server",pid=77,fd=3))\n'
        "LISTEN 0 1 0.0.0.0:50053 0.0.0.0:*\n"
    )
    assert holders_of(parse_ss(text), 50052) == [Listener("::", 50052, 77, "ggml-rpc-server")]
    assert holders_of(parse_ss(text), 50053) == [Listener("0.0.0.0", 50053, None)]
    assert holders_of(parse_ss(text), 50054) == []


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        (
            "/opt/llama/llama-server -m /m.gguf --api-key sk-123 --port 8080",
            "/opt/llama/llama-server -m /m.gguf --api-key (hidden) --port 8080",
        ),
        ("llama-server --api-key=sk-123 --host 0.0.0.0", "llama-server --api-key=(hidden) --host 0.0.0.0"),
        ("llama-server --api-key-file /home/me/key.txt", "llama-server --api-key-file /home/me/key.txt"),
        ("llama-server -hft hf_abc --hf-token=hf_def", "llama-server -hft (hidden) --hf-token=(hidden)"),
        (
            "env LLAMA_API_KEY=sk-123 llama-server -m m.gguf",
            "env LLAMA_API_KEY=(hidden) llama-server -m m.gguf",
        ),
        ("main: api_keys: sk-123", "main: api_keys: (hidden)"),
        ("ggml-rpc-server -H 10.0.0.2 -p 50052", "ggml-rpc-server -H 10.0.0.2 -p 50052"),
    ],
)
def test_secrets_in_command_lines_are_hidden_and_nothing_else_changes(cmdline, expected):
    assert redact_cmdline(cmdline) == expected
