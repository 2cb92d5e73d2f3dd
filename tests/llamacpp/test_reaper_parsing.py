"""The reaper's pure parts: telling our processes from others, and the listener command per platform.

Reading the listener tables is tested in tests/remote/test_listeners.py.
"""

from __future__ import annotations

from llamacpp.reaper import classify, listeners_argv, program_of
from remote.powershell import decode_script


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
    assert "-LocalPort 50052 " in decode_script(listeners_argv("windows", 50052))
