"""The Windows command builder (remote/powershell.py) against hostile values: quotes (the five PowerShell
accepts), `$(...)`, backticks, `;`, newlines, NUL, unicode, very long strings. Each value either comes out
of PowerShell's tokenizer (tests/lab/fake_powershell.py, which follows the language's rules for verbatim
strings) as exactly the one literal it went in as, or reaches a native program as exactly the argument it
was, or is refused with a message. tests/lab/test_windows_lab.py sends the same through real SSH."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote import powershell
from remote.powershell import (
    NotForWindows,
    command_line,
    decode_script,
    native_call,
    powershell_argv,
    ps_quote,
    shell_of,
    windows_command_line,
)
from tests.lab.fake_powershell import Str, command_line_to_argv, legacy_native_line, statements, tokenize
from tests.site.test_security_hostile_input import PIECES

WINDOWS_PIECES = [
    *PIECES, "\u2018", "\u2019", "\u201a", "\u201b", "''", "`'", "`n", "$PID", "@(1)", "%OS%", "^", "&",
    "\\\\", '\\"', "C:\\Program Files\\llama\\", "#>", "<#",
]  # fmt: skip
HOSTILE = st.one_of(
    st.lists(st.sampled_from(WINDOWS_PIECES), min_size=1, max_size=12).map("".join),
    st.text(st.characters(exclude_categories=("Cs",)), min_size=0, max_size=40),
    st.sampled_from(WINDOWS_PIECES),
    st.integers(min_value=1000, max_value=3000).map(lambda n: "$(id)'\"`;\u2019" * (n // 9)),
)
EXAMPLES = settings(max_examples=300, deadline=None, derandomize=True)


@given(value=HOSTILE)
@EXAMPLES
def test_a_quoted_value_is_one_literal_holding_exactly_the_value(value):
    if "\x00" in value:
        with pytest.raises(ValueError, match="NUL"):
            ps_quote(value)
        return
    tokens = tokenize(f"Write-Output {ps_quote(value)} ; exit 0")
    assert tokens == ["Write-Output", Str(value), ";", "exit", "0"]
    assert isinstance(tokens[1], Str)


@given(values=st.lists(HOSTILE.filter(lambda v: "\x00" not in v), min_size=1, max_size=5))
@EXAMPLES
def test_a_script_of_quoted_values_splits_into_the_statements_it_was_built_of(values):
    script = "\n".join(f"Write-Output {ps_quote(v)}" for v in values)
    parsed = statements(tokenize(script))
    assert parsed == [["Write-Output", Str(v)] for v in values]


@given(value=HOSTILE.filter(lambda v: "\x00" not in v))
@EXAMPLES
def test_the_line_sent_means_the_same_to_cmd_powershell_and_sh(value):
    """Only base64 characters after the fixed words: no character cmd.exe (& | < > ^ % "), PowerShell
    ($ ` ' ; { }) or sh gives a meaning to, so the default shell of Windows' sshd does not matter."""
    try:
        argv = powershell_argv(f"Write-Output {ps_quote(value)}")
    except NotForWindows as exc:
        assert "longer than the 8191" in str(exc)
        return
    line = command_line(argv)
    assert not set(line) & set("&|<>^%\"'$`;{}()\n\\!*?~#")
    assert shlex.split(line) == argv
    assert decode_script(argv) == f"Write-Output {ps_quote(value)}"


@given(args=st.lists(HOSTILE.filter(lambda v: "\x00" not in v), min_size=0, max_size=6))
@EXAMPLES
def test_a_detached_program_gets_its_argument_vector_exactly(args):
    """Start-Process -ArgumentList with one string passes it verbatim as the command line; the program's C
    runtime splits it back into exactly the vector meant, whatever it holds."""
    assert command_line_to_argv(windows_command_line(args)) == args
    script = powershell.start_detached_script(
        ["C:\\llama\\rpc-server.exe", *args], log_path="C:\\Users\\x\\rpc.log"
    )
    literals = [t for t in tokenize(script) if isinstance(t, Str)]
    assert literals[0] == "C:\\llama\\rpc-server.exe"
    if args:
        assert command_line_to_argv(literals[1]) == args


@given(args=st.lists(HOSTILE.filter(lambda v: "\x00" not in v), min_size=1, max_size=6))
@EXAMPLES
def test_a_program_run_in_the_foreground_gets_its_arguments_exactly_or_is_refused(args):
    try:
        script = native_call(["echo-argv", *args])
    except NotForWindows as exc:
        assert "Argument" in str(exc) and "not run" in str(exc)
        assert any(a == "" or '"' in a or (a.endswith("\\") and any(c.isspace() for c in a)) for a in args)
        return
    first = statements(tokenize(script))[0]
    assert first[0] == "&" and [str(t) for t in first[1:]] == ["echo-argv", *args]
    # What Windows PowerShell 5.1 makes of them, split by the program's C runtime.
    assert command_line_to_argv(legacy_native_line(args)) == args


def test_a_nul_never_reaches_a_windows_command():
    for build in (
        lambda: ps_quote("a\x00b"),
        lambda: powershell_argv("Write-Output 'a\x00'"),
        lambda: native_call(["prog", "a\x00"]),
        lambda: windows_command_line(["a\x00"]),
    ):
        with pytest.raises(ValueError, match="NUL"):
            build()


def test_numbers_reach_scripts_as_ints_only():
    with pytest.raises(ValueError):
        powershell.listeners_script("50052; Remove-Item C:\\")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        powershell.stop_script("1 -Name rpc-server")  # type: ignore[arg-type]
    assert "-LocalPort 50052 " in powershell.listeners_script(50052)


def test_the_detection_line_tells_the_three_shells_apart():
    # cmd.exe: %OS% expanded, $PSHOME left alone, one line.
    assert shell_of("ramdeck-shell Windows_NT $PSHOME\r\n") == "cmd"
    # PowerShell: echo (Write-Output) prints one argument a line; $PSHOME expanded, %OS% left alone.
    assert (
        shell_of("ramdeck-shell\r\n%OS%\r\nC:\\Windows\\System32\\WindowsPowerShell\\v1.0\r\n")
        == "powershell"
    )
    # sh: neither expanded ($PSHOME unset is empty).
    assert shell_of("ramdeck-shell %OS%\n") == "posix"
    assert shell_of("") == "unknown"


def test_the_launcher_runs_the_start_process_line_outside_the_session():
    launcher = powershell.launch_script(["C:\\llama\\rpc-server.exe", "-p", "50052"], log_path="C:\\r\\x.log")
    remove, create = statements(tokenize(launcher))
    assert remove[:3] == ["Remove-Item", "-LiteralPath", Str("C:\\r\\x.log.pid")]
    inner = [t for t in create if isinstance(t, Str)][0].split(" ")
    assert decode_script(inner) == powershell.start_detached_script(
        ["C:\\llama\\rpc-server.exe", "-p", "50052"], log_path="C:\\r\\x.log"
    )
    assert create[:5] == ["Invoke-CimMethod", "-ClassName", "Win32_Process", "-MethodName", "Create"]


def test_the_firewall_blocks_every_address_but_the_coordinators():
    def remote_addresses(script: str) -> list[list[str]]:
        return [[t for t in s if isinstance(t, Str)][1:] for s in statements(tokenize(script))]

    block, allow = remote_addresses(powershell.firewall_add_script(50052, "192.168.1.10", "ramdeck-d1"))
    assert block == ["0.0.0.0-192.168.1.9", "192.168.1.11-255.255.255.255"] and allow == ["192.168.1.10"]
    assert remote_addresses(powershell.firewall_add_script(1, "0.0.0.0", "t"))[0] == [
        "0.0.0.1-255.255.255.255"
    ]
    assert remote_addresses(powershell.firewall_add_script(1, "255.255.255.255", "t"))[0] == [
        "0.0.0.0-255.255.255.254"
    ]
    with pytest.raises(ValueError):
        powershell.firewall_add_script(1, "192.168.1.10'; Remove-NetFirewallRule *", "t")


@given(source=HOSTILE.filter(lambda v: "\x00" not in v), target=HOSTILE.filter(lambda v: "\x00" not in v))
@EXAMPLES
def test_the_build_jobs_file_commands_hold_each_path_as_one_literal(source, target):
    """The Windows build's folder, move and remove commands (builds/windows.py): whatever a path holds, it
    is one verbatim literal of one statement, never code."""
    for script, paths in (
        (powershell.make_dir_script(source), [source]),
        (powershell.move_script(source, target), [source, target]),
        (powershell.remove_tree_script(source), [source]),
    ):
        [statement] = statements(tokenize(script))
        assert [t for t in statement if isinstance(t, Str)] == paths


def test_the_build_tools_script_asks_vswhere_for_msvc_and_prints_sections():
    script = powershell.build_tools_script()
    parsed = statements(tokenize(script))
    literals = [[t for t in s if isinstance(t, Str)] for s in parsed]
    assert ["@@@ commands"] in literals and ["@@@ msvc"] in literals and ["@@@ end"] in literals
    vswhere = next(s for s in literals if powershell.VSWHERE in s)
    assert vswhere[2:] == [
        "-latest",
        "-products",
        "*",
        "-requires",
        "Microsoft.VisualStudio.Component.VC.Tools.x86.x64",
        "-property",
        "installationPath",
    ]


def test_a_failed_start_is_said_by_wmis_return_value_or_start_process():
    assert "answered 2 (Access denied)" in powershell.start_failure("x.exe", "pc", answer="2")
    assert "answered 9 (Path not found)" in powershell.start_failure("x.exe", "pc", answer="9")
    said = powershell.start_failure(
        "x.exe", "pc", pid_text="error: The system cannot find the file specified."
    )
    assert said.endswith("Start-Process said: The system cannot find the file specified.")
    quiet = powershell.start_failure("x.exe", "pc", logs="")
    assert "wrote no PID within 15 s" in quiet and "empty or absent" in quiet
    assert "Last lines of its log files:\nboom" in powershell.start_failure("x.exe", "pc", logs="boom")


def test_a_windows_path_reaches_sftp_in_its_absolute_form():
    assert powershell.sftp_path("C:\\Users\\ana\\x.tar.gz") == "/C:/Users/ana/x.tar.gz"
    assert powershell.sftp_path("D:/data/m.gguf") == "/D:/data/m.gguf"
    assert powershell.sftp_path("/C:/already") == "/C:/already"


@given(value=HOSTILE.filter(lambda v: "\x00" not in v))
@settings(max_examples=100, deadline=None, derandomize=True)
def test_an_env_prefix_becomes_the_starting_powershells_own_variable(value):
    """`env LLAMA_CACHE=<value> program args` (llamacpp/rpc_cache.py server_argv): Windows has no env
    program, so the detached start sets $env:LLAMA_CACHE to the value, one literal, before Start-Process."""
    argv = ["env", f"LLAMA_CACHE={value}", "C:\\llama\\rpc-server.exe", "-c"]
    assert powershell.split_env(argv) == ([("LLAMA_CACHE", value)], argv[2:])
    script = powershell.start_detached_script(argv, log_path="C:\\Users\\x\\rpc.log")
    first, *rest = statements(tokenize(script))
    assert first == ["$env:LLAMA_CACHE", "=", Str(value)]
    assert [t for t in rest[0] if isinstance(t, Str)][:2] == ["C:\\llama\\rpc-server.exe", "-c"]


def test_an_env_prefix_with_a_name_that_is_no_variables_is_refused():
    with pytest.raises(NotForWindows, match="environment variable"):
        powershell.split_env(["env", "A;B=1", "x.exe"])
    assert powershell.split_env(["x.exe", "A=1"]) == ([], ["x.exe", "A=1"])
