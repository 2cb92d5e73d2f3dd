"""The reaper's pure parts: reading listener tables of three platforms and telling our processes from others.

The samples are recorded outputs of the real tools (ss and lsof on Debian, lsof on macOS 14, PowerShell 7
on Windows 11).
"""

from __future__ import annotations

from deployments.reaper import (
    Listener,
    classify,
    holders_of,
    listeners_argv,
    parse_get_nettcpconnection,
    parse_lsof,
    parse_ss,
    program_of,
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


def test_our_programs_are_recognised_by_command_line():
    assert classify(
        "/root/.ramdeck/llama.cpp/src-b0/llama.cpp/build-cpu/bin/ggml-rpc-server -H 10.77.1.2"
    ) == ("rpc-server")
    assert classify("stdbuf -oL /opt/llama/rpc-server -p 50052") == "rpc-server"
    assert classify("llama-server -m /m.gguf --port 8080") == "llama-server"
    assert classify('"C:\\Program Files\\llama\\llama-server.exe" --port 8080') == "llama-server"
    assert classify("env GGML_X=1 nohup ggml-rpc-server -p 1") == "rpc-server"


def test_foreign_programs_are_not_ours_even_when_they_mention_our_names():
    assert classify("/usr/bin/python3 -m http.server 50052") is None
    assert classify("vim /etc/ggml-rpc-server.conf") is None
    assert classify("bash -c 'ggml-rpc-server -p 50052'") is None
    assert classify("") is None
    assert program_of("/root/.pyenv/versions/3.11.7/bin/python3 -m http.server 18765") == "python3"


def test_listener_commands_per_platform_are_argument_lists_with_the_port():
    assert listeners_argv("linux", 50052) == ["ss", "-Hltnp", "sport = :50052"]
    assert listeners_argv("macos", 50052) == ["lsof", "-nP", "-iTCP:50052", "-sTCP:LISTEN"]
    assert "-LocalPort 50052" in listeners_argv("windows", 50052)[-1]
