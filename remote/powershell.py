"""Every command the console sends to a Windows node, built here and nowhere else (the POSIX counterpart is
remote/base.py's `shell_join` and `daemon_script`). No Django.

Windows' OpenSSH server hands the command string of an SSH exec request to its default shell: `cmd.exe /c`
unless the admin set `DefaultShell` to PowerShell (`powershell.exe -c`). The one line that means the same to
both, and to a POSIX sh, is `powershell -NoProfile -NonInteractive -EncodedCommand <base64>`: base64 has no
character any of the three shells gives a meaning to. The script inside is PowerShell source in which every
value (a path, a port, a PID, a program's argument) appears only as a single-quoted literal (`ps_quote`) or
as an int; a value can never end its literal, whatever it holds ($(...), backticks, `;`, newlines, the
Unicode single quotes PowerShell also accepts).

Native programs (rpc-server.exe) get their arguments two ways:
- started detached, through `Start-Process -ArgumentList` given one string: the process's command line,
  built with the Microsoft C runtime's quoting (`subprocess.list2cmdline`), which the program's own C
  runtime splits back into exactly the argument vector meant, whatever it holds;
- run in the foreground (`& 'prog' 'arg' ...`), where Windows PowerShell 5.1 builds the command line itself
  and loses an argument's double quotes, an empty argument, and a trailing backslash of an argument with a
  space: those are refused here with a message instead of reaching the program changed.
"""

from __future__ import annotations

import base64
import ipaddress
import re
import subprocess
from collections.abc import Sequence

from remote.base import refuse_nul

# The five characters PowerShell's tokenizer takes as a single quote (about_Quoting_Rules; the language
# specification's "single-quote-character"). Inside a single-quoted literal each is escaped by doubling.
SINGLE_QUOTES = "'\u2018\u2019\u201a\u201b"
PID_MARKER = "__ramdeck_pid__"
# cmd.exe's limit on a command line; Windows' OpenSSH runs the command through it by default.
COMMAND_LINE_LIMIT = 8191
POWERSHELL = ["powershell", "-NoProfile", "-NonInteractive", "-EncodedCommand"]
# The one detection line (see `shell_of`): cmd.exe expands %OS%, PowerShell expands $PSHOME, sh neither.
DETECT_COMMAND = "echo ramdeck-shell %OS% $PSHOME"
_SAFE = re.compile(r"[A-Za-z0-9+/=_.-]+")


class NotForWindows(ValueError):
    """A value that cannot reach a Windows program unchanged; the message says which and why."""


def ps_quote(value: str | int) -> str:
    """`value` as a PowerShell single-quoted (verbatim) string literal: nothing inside is expanded."""
    text = str(value)
    refuse_nul([text])
    return "'" + "".join(c + c if c in SINGLE_QUOTES else c for c in text) + "'"


def powershell_argv(script: str) -> list[str]:
    """The command that runs `script` on a Windows node, whatever its OpenSSH default shell. The script's
    first statement writes the PID marker to stderr (as the POSIX transport's `echo <marker> $$` does), so
    the transport can end an overrunning command by PID."""
    refuse_nul([script])
    full = f"[Console]::Error.WriteLine('{PID_MARKER} ' + $PID)\n{script}"
    encoded = base64.b64encode(full.encode("utf-16-le")).decode("ascii")
    argv = [*POWERSHELL, encoded]
    if len(" ".join(argv)) > COMMAND_LINE_LIMIT:
        raise NotForWindows(
            f"The PowerShell command is {len(' '.join(argv))} characters once encoded, longer than the "
            f"{COMMAND_LINE_LIMIT} a Windows command line may be: a value in it is too long."
        )
    return argv


def is_powershell_argv(argv: Sequence[str]) -> bool:
    return (
        len(argv) == len(POWERSHELL) + 1 and list(argv[:-1]) == POWERSHELL and bool(_SAFE.fullmatch(argv[-1]))
    )


def command_line(argv: Sequence[str]) -> str:
    """What the SSH transport sends for argv on a Windows node: argv built by `powershell_argv` as it is
    (only base64 characters), anything else first wrapped as a native call (`native_call`)."""
    if not is_powershell_argv(argv):
        argv = powershell_argv(native_call(argv))
    return " ".join(argv)


def decode_script(argv: Sequence[str]) -> str:
    """The script inside a `powershell_argv` (for the job log: people read the script, not base64)."""
    script = base64.b64decode(argv[-1]).decode("utf-16-le")
    return script.split("\n", 1)[1] if script.startswith("[Console]::Error.WriteLine(") else script


def _native_argument_problem(arg: str) -> str:
    if arg == "":
        return "is empty (Windows PowerShell 5.1 drops an empty argument)"
    if '"' in arg:
        return "contains a double quote (Windows PowerShell 5.1 passes it unescaped)"
    if any(c.isspace() for c in arg) and arg.endswith("\\"):
        return "has a space and ends with a backslash (Windows PowerShell 5.1 would escape its closing quote)"
    return ""


def native_call(argv: Sequence[str]) -> str:
    """`& 'prog' 'arg' ...`: run a program in the foreground, its output and exit status those of the
    command. $LASTEXITCODE is passed on as the script's own exit status."""
    refuse_nul(argv)
    for index, arg in enumerate(argv[1:], start=1):
        if problem := _native_argument_problem(str(arg)):
            raise NotForWindows(f"Argument {index} of {str(argv[0])[:80]!r} {problem}; not run.")
    words = " ".join(ps_quote(arg) for arg in argv)
    return f"& {words}\nexit $LASTEXITCODE"


def windows_command_line(argv: Sequence[str]) -> str:
    """A Windows process's command line for argv, as its C runtime splits it back (CommandLineToArgvW)."""
    refuse_nul(argv)
    return subprocess.list2cmdline([str(arg) for arg in argv])


# -- the scripts ------------------------------------------------------------------------------------------

_JSON = "ConvertTo-Json -Compress"


def probe_script(rpc_port: int) -> str:
    """The Windows probe in one round trip: sections headed `@@@ <name>` as the POSIX probe prints them,
    each a CIM class's properties as JSON, nvidia-smi's CSV where it is installed, `vulkaninfo --summary`
    where it is installed and the video controllers (Win32_VideoController), the RPC port's listener and the
    llama.cpp programs on the PATH."""
    port = int(rpc_port)
    return "\n".join(
        [
            "'@@@ computer'",
            "Get-CimInstance -ClassName Win32_ComputerSystem | Select-Object Name,Manufacturer,Model,"
            f"TotalPhysicalMemory,NumberOfLogicalProcessors | {_JSON}",
            "'@@@ processor'",
            "Get-CimInstance -ClassName Win32_Processor | Select-Object Name,NumberOfCores,"
            f"NumberOfLogicalProcessors,Architecture | {_JSON}",
            "'@@@ os'",
            "Get-CimInstance -ClassName Win32_OperatingSystem | Select-Object Caption,Version,BuildNumber,"
            f"OSArchitecture,TotalVisibleMemorySize,FreePhysicalMemory | {_JSON}",
            "'@@@ nvidia-smi'",
            "if (Get-Command nvidia-smi -ErrorAction SilentlyContinue) { nvidia-smi "
            "--query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits }",
            # vulkaninfo.exe comes with the GPU vendor's driver (its Vulkan runtime puts it in System32).
            "'@@@ vulkaninfo'",
            "if (Get-Command vulkaninfo -ErrorAction SilentlyContinue) { vulkaninfo --summary }",
            "'@@@ video'",
            "Get-CimInstance -ClassName Win32_VideoController | Select-Object Name,AdapterCompatibility,"
            f"AdapterRAM,PNPDeviceID | {_JSON}",
            "'@@@ listeners'",
            listeners_script(port),
            "'@@@ binaries'",
            "Get-Command ggml-rpc-server.exe,rpc-server.exe,llama-server.exe -ErrorAction SilentlyContinue"
            " | Select-Object -ExpandProperty Source",
            "'@@@ end'",
        ]
    )


def listeners_script(port: int) -> str:
    return (
        f"Get-NetTCPConnection -State Listen -LocalPort {int(port)} -ErrorAction SilentlyContinue | "
        f"Select-Object LocalAddress,LocalPort,OwningProcess | {_JSON}"
    )


def cmdline_script(pid: int) -> str:
    return (
        f"Get-CimInstance -ClassName Win32_Process -Filter 'ProcessId={int(pid)}' | "
        "Select-Object -ExpandProperty CommandLine"
    )


def alive_script(pid: int) -> str:
    return f"if (Get-Process -Id {int(pid)} -ErrorAction SilentlyContinue) {{ exit 0 }} else {{ exit 1 }}"


def stop_script(pid: int) -> str:
    """Windows has no TERM: Stop-Process ends the process at once (by PID, never by image name); exit 0
    when it is gone afterwards."""
    pid = int(pid)
    return "\n".join(
        [
            f"Stop-Process -Id {pid} -Force -ErrorAction SilentlyContinue",
            "Start-Sleep -Milliseconds 200",
            f"if (Get-Process -Id {pid} -ErrorAction SilentlyContinue) {{ exit 1 }} else {{ exit 0 }}",
        ]
    )


def pid_file(log_path: str) -> str:
    return log_path + ".pid"


# Win32_Process.Create's documented return values (the Create method of the Win32_Process class).
CREATE_RETURN_VALUES = {
    0: "Successful completion",
    2: "Access denied",
    3: "Insufficient privilege",
    8: "Unknown failure",
    9: "Path not found",
    21: "Invalid parameter",
}
# What the detached start writes to the PID file in place of a PID when Start-Process refused to start it.
START_ERROR = "error:"


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def split_env(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """`env NAME=value ... program args` as POSIX argv carry an environment (llamacpp/rpc_cache.py's
    LLAMA_CACHE): the (name, value) pairs and the program's own argv. Windows has no `env` program; the
    start sets them in the PowerShell that starts the program, whose environment Start-Process passes on."""
    words = [str(a) for a in argv]
    if not words or words[0] != "env":
        return [], words
    pairs = []
    index = 1
    while index < len(words) and "=" in words[index]:
        name, _, value = words[index].partition("=")
        if not _ENV_NAME.fullmatch(name):
            raise NotForWindows(f"{name[:80]!r} is not an environment variable's name; not run.")
        pairs.append((name, value))
        index += 1
    return pairs, words[index:]


def start_detached_script(argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> str:
    """Start argv[0] with its output to `log_path` (stderr to `log_path`.err: Start-Process takes two
    different files) and write its PID to `pid_file(log_path)`, or, when Start-Process refuses (no such
    file, access denied, a bad working folder), `error: <its message>`: nobody sees the output of the
    PowerShell that runs this (`launch_script`), so the file is the one place to say why. Run by
    `launch_script`, outside the SSH session. An `env NAME=value` prefix (`split_env`) sets those variables
    first."""
    pairs, words = split_env(argv)
    program, *args = words
    parts = [
        "try { Start-Process",
        f"-FilePath {ps_quote(program)}",
        *([f"-ArgumentList {ps_quote(windows_command_line(args))}"] if args else []),
        *([f"-WorkingDirectory {ps_quote(cwd)}"] if cwd else []),
        f"-RedirectStandardOutput {ps_quote(log_path)}",
        f"-RedirectStandardError {ps_quote(log_path + '.err')}",
        "-WindowStyle Hidden -PassThru -ErrorAction Stop | Select-Object -ExpandProperty Id |",
        f"Out-File -LiteralPath {ps_quote(pid_file(log_path))} -Encoding ascii }}",
        f"catch {{ {ps_quote(START_ERROR + ' ')} + $_.Exception.Message |",
        f"Out-File -LiteralPath {ps_quote(pid_file(log_path))} -Encoding ascii }}",
    ]
    settings = [f"$env:{name} = {ps_quote(value)}" for name, value in pairs]
    return "\n".join([*settings, " ".join(parts)])


def launch_script(argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> str:
    """Start argv detached for good; prints Win32_Process.Create's ReturnValue (0: started;
    CREATE_RETURN_VALUES says what the others mean).

    Windows' OpenSSH puts each session's processes in a job object that ends them all when the session
    ends (by design: Win32-OpenSSH issues 1195 and 1642), so a Start-Process from the session itself would
    die with the SSH command. A process that WMI's Win32_Process.Create starts is outside that job: it is
    a PowerShell that runs the Start-Process line, which writes the program's PID (or why it could not
    start it) to a file the transport reads (`pid_file`; the stale one of an earlier start is removed
    first)."""
    inner = " ".join(powershell_argv(start_detached_script(argv, log_path=log_path, cwd=cwd)))
    return "\n".join(
        [
            remove_script([pid_file(log_path)]),
            "Invoke-CimMethod -ClassName Win32_Process -MethodName Create -Arguments "
            f"@{{ CommandLine = {ps_quote(inner)} }} | Select-Object -ExpandProperty ReturnValue",
        ]
    )


def start_failure(program: str, host: str, *, answer: str = "", pid_text: str = "", logs: str = "") -> str:
    """Why a detached start on a Windows node failed, in one message: Win32_Process.Create's return value,
    Start-Process's own error, or (no PID at all) the last lines of the program's two log files."""
    head = f"Starting {program!r} on {host} failed"
    if answer and answer != "0":
        meaning = CREATE_RETURN_VALUES.get(int(answer)) if answer.isdigit() else None
        said = f"{answer} ({meaning})" if meaning else repr(answer[:200])
        return f"{head}: WMI's Win32_Process.Create answered {said}, so nothing was started."
    if pid_text.startswith(START_ERROR):
        return f"{head}: Start-Process said: {pid_text[len(START_ERROR) :].strip()[:500]}"
    tail = f" Last lines of its log files:\n{logs}" if logs.strip() else " Its log files are empty or absent."
    return (
        f"{head}: the PowerShell that WMI started wrote no PID within 15 s (it may not have run at all: "
        f"PowerShell's execution policy, or a machine too busy).{tail}"
    )


def run_dir_script() -> str:
    """%USERPROFILE%\\.ramdeck\\run, created when missing; prints its full path."""
    return "(New-Item -ItemType Directory -Force -Path (Join-Path $env:USERPROFILE '.ramdeck\\run')).FullName"


def tail_script(paths: Sequence[str], count: int) -> str:
    """The last `count` lines of each file that exists (a detached program's stdout log and its .err)."""
    files = " , ".join(ps_quote(path) for path in paths)
    return f"Get-Content -LiteralPath {files} -Tail {int(count)} -ErrorAction SilentlyContinue"


def exists_script(path: str) -> str:
    """Exit status 0 when `path` is a file."""
    return f"if (Test-Path -LiteralPath {ps_quote(path)} -PathType Leaf) {{ exit 0 }} else {{ exit 1 }}"


def remove_script(paths: Sequence[str]) -> str:
    files = " , ".join(ps_quote(path) for path in paths)
    return f"Remove-Item -LiteralPath {files} -Force -ErrorAction SilentlyContinue"


def connect_script(host: str, port: int) -> str:
    """One TCP connection from the node itself, closed at once (.NET's TcpClient connects as it is made)."""
    return f"(New-Object System.Net.Sockets.TcpClient({ps_quote(host)}, {int(port)})).Close()"


def is_admin_script() -> str:
    """Prints True when the SSH login runs elevated (an administrator: it may change Windows Firewall)."""
    return (
        "([Security.Principal.WindowsPrincipal][Security.Principal.WindowsIdentity]::GetCurrent())"
        ".IsInRole([Security.Principal.WindowsBuiltInRole]::Administrator)"
    )


def _ranges_except(address: str) -> list[str]:
    """Every IPv4 address but `address`, as Windows Firewall's address ranges."""
    value = int(ipaddress.IPv4Address(address))
    ranges = []
    if value > 0:
        ranges.append(f"0.0.0.0-{ipaddress.IPv4Address(value - 1)}")
    if value < 2**32 - 1:
        ranges.append(f"{ipaddress.IPv4Address(value + 1)}-255.255.255.255")
    return ranges


def firewall_rule_names(tag: str) -> list[str]:
    return [f"{tag} block", f"{tag} allow"]


def firewall_add_script(port: int, coordinator: str, tag: str) -> str:
    """Inbound TCP to `port` from anyone but the coordinator is blocked (a Block rule wins over any Allow
    rule, such as one a person clicked through for rpc-server.exe), and allowed from the coordinator."""
    block, allow = (ps_quote(name) for name in firewall_rule_names(tag))
    others = " , ".join(ps_quote(r) for r in _ranges_except(coordinator))
    common = f"-Direction Inbound -Protocol TCP -LocalPort {int(port)}"
    return "\n".join(
        [
            f"New-NetFirewallRule -DisplayName {block} {common} -RemoteAddress {others} "
            "-Action Block | Out-Null",
            f"New-NetFirewallRule -DisplayName {allow} {common} -RemoteAddress "
            f"{ps_quote(str(ipaddress.IPv4Address(coordinator)))} -Action Allow | Out-Null",
        ]
    )


def firewall_remove_script(tag: str) -> str:
    names = " , ".join(ps_quote(name) for name in firewall_rule_names(tag))
    return f"Remove-NetFirewallRule -DisplayName {names} -ErrorAction SilentlyContinue"


def shell_of(output: str) -> str:
    """ "cmd", "powershell" or "posix": which shell answered DETECT_COMMAND (cmd.exe expands %OS% to
    Windows_NT; PowerShell prints one argument a line and expands $PSHOME; sh expands neither)."""
    words = output.split()
    if "ramdeck-shell" not in words:
        return "unknown"
    if "Windows_NT" in words:
        return "cmd"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if len(lines) >= 3 and lines[0] == "ramdeck-shell" and lines[1] == "%OS%":
        return "powershell"
    return "posix"


# -- building llama.cpp on a Windows node -----------------------------------------------------------------

# Where vswhere.exe lives on every machine with Visual Studio 2017 or later, or its Build Tools (Microsoft's
# documented fixed location under %ProgramFiles(x86)%), and what it is asked: the newest installation with
# the C++ compiler for x64 (the "Desktop development with C++" workload's MSVC component).
VSWHERE = "Microsoft Visual Studio\\Installer\\vswhere.exe"
MSVC_COMPONENT = "Microsoft.VisualStudio.Component.VC.Tools.x86.x64"
BUILD_COMMANDS = ("cmake", "git", "tar", "ninja", "clang", "clang++", "gcc", "g++", "nvcc", "glslc")


def build_tools_script() -> str:
    """What a build needs on a Windows node, in sections as the probe prints them: the programs on the PATH
    (Get-Command's paths), the Visual Studio installation with MSVC that vswhere.exe finds, the Vulkan SDK
    (the environment variable its installer sets) and the user's profile folder."""
    vswhere = f"(Join-Path ${{env:ProgramFiles(x86)}} {ps_quote(VSWHERE)})"
    asks = " ".join(ps_quote(a) for a in ("-latest", "-products", "*", "-requires", MSVC_COMPONENT))
    return "\n".join(
        [
            "'@@@ commands'",
            f"Get-Command {','.join(BUILD_COMMANDS)} -ErrorAction SilentlyContinue"
            " | Select-Object -ExpandProperty Source",
            "'@@@ msvc'",
            f"if (Test-Path -LiteralPath {vswhere} -PathType Leaf) {{ & {vswhere} {asks} "
            f"{ps_quote('-property')} {ps_quote('installationPath')} }}",
            "'@@@ vulkan_sdk'",
            "$env:VULKAN_SDK",
            "'@@@ home'",
            "$env:USERPROFILE",
            "'@@@ end'",
        ]
    )


def make_dir_script(path: str) -> str:
    return f"New-Item -ItemType Directory -Force -Path {ps_quote(path)} | Out-Null"


def move_script(source: str, destination: str) -> str:
    """Move a file or folder; an existing file at the destination is replaced (-Force), as `mv` does."""
    return f"Move-Item -LiteralPath {ps_quote(source)} -Destination {ps_quote(destination)} -Force"


def remove_tree_script(path: str) -> str:
    return f"Remove-Item -LiteralPath {ps_quote(path)} -Recurse -Force -ErrorAction SilentlyContinue"


def sftp_path(path: str) -> str:
    """A Windows path as Windows' OpenSSH SFTP server takes it: C:\\x\\y is /C:/x/y (its absolute form; a
    bare C:/x/y would be taken as relative to the login's home folder)."""
    path = path.replace("\\", "/")
    return "/" + path if re.match(r"[A-Za-z]:/", path) else path
