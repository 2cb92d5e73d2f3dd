"""A shell that answers like Windows PowerShell 5.1 behind Windows' OpenSSH server (DefaultShell set to
PowerShell), for exactly the commands the console sends a Windows node, and fails loudly on anything else.

The lab's sshd runs it as the session's ForceCommand (tests/lab/windows_host.py): the command of the SSH
exec request arrives in SSH_ORIGINAL_COMMAND, as Windows' sshd hands it to `powershell.exe -c`. It
understands:
- the shell detection line (`echo ramdeck-shell %OS% $PSHOME`), answered as PowerShell does: one argument a
  line, %OS% untouched, $PSHOME expanded;
- `powershell -NoProfile -NonInteractive -EncodedCommand <base64 of UTF-16LE>`, whose script it runs
  statement by statement, each of one of the forms the console builds (remote/powershell.py):
  Get-CimInstance of Win32_ComputerSystem / Win32_Processor / Win32_OperatingSystem (recorded values of a
  real PC, in tests/data/probe/windows_cim.json) and of Win32_Process (the host's real processes), piped to
  `Select-Object ... | ConvertTo-Json -Compress`; `Get-Command` (nvidia-smi is absent unless the host was
  given one; the llama.cpp programs are found in the host's C: folders); `Get-NetTCPConnection` (the
  namespace's real listening sockets); `Get-Process -Id`, `Stop-Process -Id` and `Start-Process` (real
  processes: a Windows path C:\\x maps to <root>/C/x); the run folder under $env:USERPROFILE (New-Item),
  a log's last lines (Get-Content -Tail), one TCP connection (New-Object System.Net.Sockets.TcpClient);
  and `& 'program' 'args'`;
- the RPC cache script (llamacpp/rpc_cache.py POWERSHELL_SCRIPT): variables set from literals and from
  $env:, [IO.Path]::Combine and ::GetPathRoot, `-notmatch` (case-insensitive, as PowerShell's is),
  Get-ChildItem -LiteralPath -File (regular files; a missing folder lists nothing under -ErrorAction
  SilentlyContinue) filtered by name with `-cmatch` (case-sensitive) and by the ReparsePoint attribute (a
  symbolic link has it), Sort-Object LastWriteTimeUtc, Remove-Item and Test-Path on each file, and
  Get-PSDrive's FileSystem drives (one per drive folder of the fake PC, its Free the folder's file system's
  free bytes), each statement of the one form the script has; and `$env:NAME = '...'`, which sets a
  variable of the process's environment that what Start-Process starts then inherits.
Strings are read by PowerShell's own rules for single-quoted (verbatim) literals, and the arguments of a
native program by the Microsoft C runtime's (CommandLineToArgvW), after Windows PowerShell 5.1's way of
building the command line (an argument with whitespace wrapped in double quotes, nothing escaped).

Anything else stops with PowerShell's own error ("The term 'x' is not recognized as the name of a cmdlet,
...") and exit status 1, so a POSIX command sent to a Windows node fails the test that sent it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SINGLE_QUOTES = "'\u2018\u2019\u201a\u201b"
# Set in the environment of a command line that Win32_Process.Create runs (outside the session's job).
OUTSIDE_JOB = "RAMDECK_FAKE_OUTSIDE_JOB"
PSHOME = "C:\\Windows\\System32\\WindowsPowerShell\\v1.0"
PROGRAM_FILES_X86 = "C:\\Program Files (x86)"
# Windows' OpenSSH serves SFTP itself; the lab's sshd hands a subsystem request to the ForceCommand with
# the subsystem's command (its `Subsystem sftp internal-sftp` line) in SSH_ORIGINAL_COMMAND.
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
CMDLETS = {
    "Get-CimInstance", "Select-Object", "ConvertTo-Json", "Get-Command", "Get-NetTCPConnection",
    "Get-Process", "Stop-Process", "Start-Process", "Start-Sleep", "Write-Output", "echo", "exit", "if",
    "powershell", "Get-Content", "New-Item", "New-Object", "Remove-Item", "Invoke-CimMethod", "Out-File",
    "Test-Path", "New-NetFirewallRule", "Remove-NetFirewallRule", "try", "Move-Item", "foreach",
}  # fmt: skip


class PSError(Exception):
    """A statement PowerShell would refuse; the message is PowerShell's."""


# -- tokens -------------------------------------------------------------------------------------------------


class Str(str):
    """A single-quoted literal's value."""


def tokenize(text: str) -> list[str]:
    """PowerShell's tokens, as far as the console's scripts use them: single-quoted literals (Str), the
    punctuation `; | { } ( )`, newlines ("\\n") and bare words. A double-quoted string is refused: the
    console never sends one, and its expansion ($(...), `...`) is what the builder must never rely on."""
    tokens: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in " \t\r":
            i += 1
        elif c == "\n":
            tokens.append("\n")
            i += 1
        elif c in SINGLE_QUOTES:
            value = []
            i += 1
            while True:
                if i >= len(text):
                    raise PSError(
                        "The string is missing the terminator: '.\n"
                        "    + CategoryInfo          : ParserError: (:) [], "
                        "ParentContainsErrorRecordException"
                    )
                if text[i] in SINGLE_QUOTES:
                    if i + 1 < len(text) and text[i + 1] in SINGLE_QUOTES:
                        value.append(text[i])
                        i += 2
                        continue
                    i += 1
                    break
                value.append(text[i])
                i += 1
            tokens.append(Str("".join(value)))
        elif c == '"':
            raise PSError(
                "fake PowerShell: a double-quoted (expandable) string was sent; the console must not"
            )
        elif c in ";|{}()":
            tokens.append(c)
            i += 1
        else:
            start = i
            while i < len(text) and text[i] not in " \t\r\n;|{}()'\"\u2018\u2019\u201a\u201b":
                i += 1
            tokens.append(text[start:i])
    return tokens


def statements(tokens: list[str]) -> list[list[str]]:
    """Tokens split at newlines and `;` outside braces."""
    result: list[list[str]] = [[]]
    depth = 0
    for token in tokens:
        if not isinstance(token, Str):
            depth += token == "{"
            depth -= token == "}"
            if token in ("\n", ";") and depth == 0:
                result.append([])
                continue
        result[-1].append(token)
    return [s for s in result if s]


def shape(statement: list[str]) -> tuple[str, list[str]]:
    """The statement's words with each literal replaced by §, and the literals' values."""
    values = [t for t in statement if isinstance(t, Str)]
    text = " ".join("§" if isinstance(t, Str) else ("" if t == "\n" else t) for t in statement)
    return re.sub(r"\s+", " ", text).strip(), values


# -- native programs ----------------------------------------------------------------------------------------


def command_line_to_argv(line: str) -> list[str]:
    """CommandLineToArgvW / the Microsoft C runtime (2008 and later) splitting a command line."""
    args: list[str] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            return args
        arg: list[str] = []
        quoted = False
        while i < n and (quoted or line[i] not in " \t"):
            if line[i] == "\\":
                j = i
                while j < n and line[j] == "\\":
                    j += 1
                count = j - i
                if j < n and line[j] == '"':
                    arg.append("\\" * (count // 2))
                    if count % 2:
                        arg.append('"')
                        i = j + 1
                    else:
                        i = j
                    continue
                arg.append("\\" * count)
                i = j
                continue
            if line[i] == '"':
                if quoted and i + 1 < n and line[i + 1] == '"':
                    arg.append('"')
                    i += 2
                    continue
                quoted = not quoted
                i += 1
                continue
            arg.append(line[i])
            i += 1
        args.append("".join(arg))


def legacy_native_line(args: list[str]) -> str:
    """How Windows PowerShell 5.1 joins a native program's arguments: an empty one is dropped, one with
    whitespace is wrapped in double quotes, nothing is escaped."""
    words = []
    for arg in args:
        if arg == "":
            continue
        words.append(f'"{arg}"' if any(c.isspace() for c in arg) and '"' not in arg else arg)
    return " ".join(words)


# -- the host -----------------------------------------------------------------------------------------------


class Host:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = json.loads((root / "state.json").read_text())
        self.out = sys.stdout
        self.exit_status = 0
        self.in_job: list[int] = []
        # The script's variables ($name → value), for the statements that set and read them.
        self.vars: dict[str, object] = {}
        self.set_env: set[str] = set()

    def save(self) -> None:
        (self.root / "state.json").write_text(json.dumps(self.state))

    def local_path(self, windows_path: str) -> Path:
        match = re.fullmatch(r"([A-Za-z]):[\\/](.*)", windows_path, re.S)
        if not match:
            raise PSError(f"fake PowerShell: {windows_path!r} is not an absolute Windows path")
        return self.root / match[1].upper() / Path(*[p for p in re.split(r"[\\/]", match[2]) if p])

    def windows_path(self, local: Path) -> str:
        drive, *rest = local.relative_to(self.root).parts
        return f"{drive}:\\" + "\\".join(rest)

    def which(self, name: str) -> Path | None:
        if re.match(r"[A-Za-z]:[\\/]", name):
            path = self.local_path(name)
            return path if path.exists() else None
        for folder in self.state["path"]:
            for candidate in (name, f"{name}.exe"):
                path = self.local_path(folder) / candidate
                if path.exists():
                    return path
        return None

    def print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # -- statements --------------------------------------------------------------------------------------

    def run_script(self, script: str) -> int:
        for statement in statements(tokenize(script)):
            done = self.run_statement(statement)
            if done is not None:
                return done
        return self.exit_status

    def run_statement(self, statement: list[str]) -> int | None:
        if statement[0] == "try" and "catch" in statement:
            return self._try(statement)
        text, values = shape(statement)
        for pattern, handler in self.FORMS:
            if m := re.fullmatch(pattern, text):
                return handler(self, m, values)
        first = statement[0]
        if isinstance(first, Str) or first in CMDLETS or first == "&":
            raise PSError(f"fake PowerShell: no recorded answer for this form of {first!r}: {text}")
        raise PSError(
            f"{first} : The term '{first}' is not recognized as the name of a cmdlet, function, script file, "
            "or operable program. Check the spelling of the name, or if a path was included, verify that the "
            "path is correct and try again.\n"
            f"    + CategoryInfo          : ObjectNotFound: ({first}:String) [], CommandNotFoundException\n"
            "    + FullyQualifiedErrorId : CommandNotFoundException"
        )

    def _try(self, statement: list[str]) -> int | None:
        """`try { <one statement> } catch { '<text>' + $_.Exception.Message | Out-File -LiteralPath '<file>'
        -Encoding ascii }`: the one form the console sends (remote/powershell.py's start_detached_script). As
        in PowerShell, only a terminating error reaches the catch block: a cmdlet's error is terminating when
        it runs with -ErrorAction Stop; otherwise it is written to stderr and the script goes on."""
        split = statement.index("catch")
        body, handler = statement[1:split], statement[split + 1 :]
        if body[0] != "{" or body[-1] != "}" or handler[0] != "{" or handler[-1] != "}":
            raise PSError(
                f"fake PowerShell: no recorded answer for this try statement: {shape(statement)[0]}"
            )
        inner = body[1:-1]
        text, values = shape(handler[1:-1])
        m = re.fullmatch(r"§ \+ \$_\.Exception\.Message \| Out-File -LiteralPath § -Encoding ascii", text)
        if not m:
            raise PSError(f"fake PowerShell: no recorded answer for this catch block: {text}")
        try:
            return self.run_statement(inner)
        except PSError as exc:
            if "-ErrorAction Stop" not in shape(inner)[0]:
                sys.stderr.write(f"{exc}\n")
                self.exit_status = 1
                return None
            message = re.sub(r"^[\w-]+ : ", "", str(exc)).split("\n", 1)[0]
            self.local_path(values[1]).write_text(values[0] + message + "\r\n")
            return None

    def _marker(self, m, values):
        sys.stderr.write(f"{values[0]}{os.getpid()}\n")
        sys.stderr.flush()

    def _literal(self, m, values):
        self.print(values[0])

    def _cim(self, m, values):
        rows = self.state["cim"].get(m["cls"], [])
        self.print_json(rows, m["props"].split(","))

    def print_json(self, rows, props: list[str]) -> None:
        rows = rows if isinstance(rows, list) else [rows]
        picked = [{p: row.get(p) for p in props} for row in rows]
        if picked:
            self.print(json.dumps(picked[0] if len(picked) == 1 else picked, separators=(",", ":")))

    def _nvidia(self, m, values):
        if self.state.get("nvidia_smi"):
            self.print(self.state["nvidia_smi"])

    def _vulkaninfo(self, m, values):
        if self.state.get("vulkaninfo"):
            self.print(self.state["vulkaninfo"])

    def _get_command_sources(self, m, values):
        for name in m["names"].split(","):
            found = self.which(name)
            if found:
                self.print(self.windows_path(found))

    def _listeners(self, m, values):
        import psutil

        port = int(m["port"])
        rows = [
            {"LocalAddress": c.laddr.ip, "LocalPort": c.laddr.port, "OwningProcess": c.pid or 0}
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        self.print_json(rows, ["LocalAddress", "LocalPort", "OwningProcess"])

    def _process_cmdline(self, m, values):
        filt = re.fullmatch(r"ProcessId=(\d+)", values[0])
        if not filt:
            raise PSError(f"fake PowerShell: unsupported filter {values[0]!r}")
        pid = filt[1]
        if not _alive(int(pid)):
            return
        known = self.state["processes"].get(pid)
        if known:
            self.print(known)
            return
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        self.print(subprocess.list2cmdline([a.decode(errors="replace") for a in raw]))

    def _alive_check(self, m, values):
        return int(m["yes"]) if _alive(int(m["pid"])) else int(m["no"])

    def _stop(self, m, values):
        pid = int(m["pid"])
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)  # Stop-Process -Force: TerminateProcess, no grace
            self.state["processes"].pop(str(pid), None)
            self.save()

    def _sleep(self, m, values):
        time.sleep(int(m["ms"]) / 1000)

    def _start_process(self, m, values):
        values = list(values)
        file_path = values.pop(0)
        arg_line = values.pop(0) if m["args"] else ""
        cwd = self.local_path(values.pop(0)) if m["cwd"] else None
        stdout_path, stderr_path = (self.local_path(v) for v in values[:2])
        if stdout_path == stderr_path:
            raise PSError(
                'Start-Process : This command cannot be run because "RedirectStandardOutput" and '
                '"RedirectStandardError" are same. Give different inputs and Run your command again.'
            )
        program = self.which(file_path)
        if program is None:
            raise PSError(
                "Start-Process : This command cannot be run due to the error: The system cannot find the "
                "file specified."
            )
        if cwd is not None and not cwd.is_dir():
            raise PSError(
                "Start-Process : This command cannot be run due to the error: The directory name is invalid."
            )
        try:
            with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
                proc = subprocess.Popen(
                    [str(program), *command_line_to_argv(arg_line)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=cwd,
                    start_new_session=True,
                )
        except PermissionError:
            raise PSError(
                "Start-Process : This command cannot be run due to the error: Access is denied."
            ) from None
        except OSError as exc:
            # CreateProcess refuses a file that is not a Windows program (ERROR_BAD_EXE_FORMAT).
            raise PSError(
                "Start-Process : This command cannot be run due to the error: %1 is not a valid Win32 "
                f"application. ({exc.strerror})"
            ) from None
        quoted = f'"{file_path}"'
        self.state["processes"][str(proc.pid)] = f"{quoted} {arg_line}".rstrip()
        self.save()
        self.in_job.append(proc.pid)
        if m["pidfile"]:
            self.local_path(values[-1]).write_text(f"{proc.pid}\r\n")
        else:
            self.print(str(proc.pid))

    def _remove_item(self, m, values):
        for value in values:
            self.local_path(value).unlink(missing_ok=True)

    def _test_path(self, m, values):
        return int(m["yes"]) if self.local_path(values[0]).is_file() else int(m["no"])

    def _wmi_create(self, m, values):
        """Win32_Process.Create: the command line runs outside this session's job object (its own fake
        shell process, in a session of its own), so what it starts outlives the SSH session."""
        env = {**os.environ, "SSH_ORIGINAL_COMMAND": values[0], OUTSIDE_JOB: "1"}
        if self.state.get("wmi_create_answer") is not None:
            # An account WMI refuses (2: Access denied), as the state says.
            self.print(str(self.state["wmi_create_answer"]))
            return
        subprocess.Popen(
            [sys.executable, __file__, str(self.root)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.print("0")

    def close_job(self) -> None:
        """The SSH session ends: Windows' OpenSSH closes its job object (JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE)
        and Windows ends every process in it, whatever Start-Process started, unless WMI started it."""
        if os.environ.get(OUTSIDE_JOB):
            return
        for pid in self.in_job:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def _native(self, m, values):
        self.run_native(values[0], values[1:])

    def run_native(self, name: str, args: list[str]) -> None:
        program = self.which(name)
        if program is None:
            raise PSError(
                f"& : The term '{name}' is not recognized as the name of a cmdlet, function, script "
                "file, or operable program."
            )
        argv = command_line_to_argv(legacy_native_line(args))
        proc = subprocess.run([str(program), *argv], stdin=subprocess.DEVNULL, capture_output=True)
        sys.stdout.buffer.write(proc.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(proc.stderr)
        sys.stderr.flush()
        self.last_exit_code = proc.returncode

    def _run_dir(self, m, values):
        folder = self.state["userprofile"] + "\\" + values[0]
        self.local_path(folder).mkdir(parents=True, exist_ok=True)
        self.print(folder)

    def _tail(self, m, values):
        count = int(m["count"])
        for path in values:
            local = self.local_path(path)
            if local.exists():
                lines = local.read_text(errors="replace").splitlines()
                for line in lines[-count:] if count else []:
                    self.print(line)

    def _connect(self, m, values):
        import socket

        try:
            socket.create_connection((values[0], int(m["port"])), timeout=5).close()
        except OSError as exc:
            raise PSError(
                'Exception calling ".ctor" with "2" argument(s): "No connection could be made because the '
                f'target machine actively refused it {values[0]}:{m["port"]}" ({exc})'
            ) from None

    def _is_admin(self, m, values):
        self.print("True" if self.state.get("admin", True) else "False")

    def _firewall_specs(self, name: str, rule: dict) -> list[list[str]]:
        """Windows Firewall's Block rule as the namespace's iptables rules. Windows Firewall does not filter
        a machine's connections to itself (to any of its own addresses), which Linux routes over `lo`: those
        are exempt here too. An Allow rule needs none, since this host admits everything else."""
        if rule["action"] != "Block":
            return []
        return [
            [
                *("!", "-i", "lo", "-p", "tcp", "--dport", str(rule["port"])),
                *("-m", "iprange", "--src-range", address, "-m", "comment", "--comment", name),
                *("-j", "REJECT", "--reject-with", "tcp-reset"),
            ]
            for address in rule["addresses"]
        ]

    def _new_firewall_rule(self, m, values):
        if not self.state.get("admin", True):
            raise PSError(
                "New-NetFirewallRule : Access is denied.\n    + CategoryInfo          : PermissionDenied: "
                "(MSFT_NetFirewallRule:root/standardcimv2/MSFT_NetFirewallRule) [New-NetFirewallRule], "
                "CimException"
            )
        name, *addresses = values
        rule = {"port": int(m["port"]), "addresses": addresses, "action": m["action"]}
        for spec in self._firewall_specs(name, rule):
            subprocess.run(["iptables", "-w", "-I", "INPUT", *spec], check=True, capture_output=True)
        self.state.setdefault("firewall", {})[name] = rule
        self.save()

    def _remove_firewall_rule(self, m, values):
        rules = self.state.setdefault("firewall", {})
        for name in values:
            rule = rules.pop(name, None)
            for spec in self._firewall_specs(name, rule) if rule else []:
                subprocess.run(["iptables", "-w", "-D", "INPUT", *spec], check=False, capture_output=True)
        self.save()

    def _env(self, m, values):
        """$env:NAME printed (an unset one prints nothing)."""
        value = self.env_value(m["name"])
        if value:
            self.print(value)

    def _vswhere(self, m, values):
        """`if (Test-Path (Join-Path ${env:ProgramFiles(x86)} '<vswhere>')) { & (Join-Path ...) args }`: the
        Visual Studio Installer's vswhere.exe, where the PC has one, run as a native program."""
        if values[0] != values[1]:
            raise PSError("fake PowerShell: the vswhere test and call name different files")
        path = PROGRAM_FILES_X86 + "\\" + values[0]
        if self.local_path(path).is_file():
            self.run_native(path, values[2:])

    def _new_dir(self, m, values):
        self.local_path(values[0]).mkdir(parents=True, exist_ok=True)

    def _move(self, m, values):
        source, destination = (self.local_path(v) for v in values)
        if not source.exists():
            raise PSError(
                f"Move-Item : Cannot find path '{values[0]}' because it does not exist.\n"
                "    + CategoryInfo          : ObjectNotFound"
            )
        if destination.is_dir():
            destination = destination / source.name  # into an existing folder, as Move-Item does
        source.replace(destination)

    def _remove_tree(self, m, values):
        import shutil

        target = self.local_path(values[0])
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)

    def _exit_last(self, m, values):
        return getattr(self, "last_exit_code", 0)

    def _exit(self, m, values):
        return int(m["code"])

    # -- variables and the RPC cache script ---------------------------------------------------------------

    def env_value(self, name: str) -> str | None:
        """$env:NAME: what the script set, else the PC's variables as the state holds them (Windows always
        sets USERPROFILE and LOCALAPPDATA; an unset one is $null)."""
        if name in self.set_env:
            return os.environ.get(name) or None
        defaults = {
            "USERPROFILE": self.state["userprofile"],
            "LOCALAPPDATA": self.state["userprofile"] + "\\AppData\\Local",
        }
        return {**defaults, **self.state.get("env", {})}.get(name) or None

    def _set_env(self, m, values):
        """$env:NAME = '...': the process's environment, which Start-Process passes on to what it starts."""
        os.environ[m["name"]] = values[0]
        self.set_env.add(m["name"])

    def _set_literal(self, m, values):
        self.vars[m["var"]] = values[0]

    def _set_number(self, m, values):
        self.vars[m["var"]] = int(m["n"])

    def _default_from_env(self, m, values):
        if not self.vars.get(m["var"]):
            self.vars[m["var"]] = self.env_value(m["name"])

    def _default_combined(self, m, values):
        if not self.vars.get(m["var"]) and self.env_value(m["name"]):
            self.vars[m["var"]] = path_combine(self.env_value(m["name"]), values[0])

    def _refuse_unless_match(self, m, values):
        """`-notmatch` is case-insensitive; $null matches as an empty string."""
        if not re.search(values[0], str(self.vars.get(m["var"]) or ""), re.IGNORECASE):
            sys.stderr.write(values[1] + "\n")
            return int(m["code"])
        return None

    def _combine(self, m, values):
        self.vars[m["var"]] = path_combine(str(self.vars.get(m["a"]) or ""), values[0])

    def _concat(self, m, values):
        """'text' + $var: a $null adds nothing; a number is added as its digits."""
        value = self.vars.get(m["var"])
        self.print(values[0] + ("" if value is None else str(value)))

    def _list_files(self, m, values):
        """Get-ChildItem -LiteralPath <folder> -File: the folder's files (a symbolic link to a file is listed
        too, with the ReparsePoint attribute), then Where-Object and Sort-Object as the statement says."""
        rows = []
        folder = self.vars.get(m["var"])
        local = self.local_path(str(folder)) if folder else None
        if local is not None and local.is_dir():
            for path in local.iterdir():
                if not path.is_file():
                    continue
                rows.append(
                    {
                        "Name": path.name,
                        "FullName": path_combine(str(folder), path.name),
                        "Length": path.stat().st_size,
                        "LastWriteTimeUtc": path.lstat().st_mtime,
                        "ReparsePoint": path.is_symlink(),
                    }
                )
        picked = [r for r in rows if re.search(values[0], r["Name"]) and not r["ReparsePoint"]]
        self.vars[m["out"]] = sorted(picked, key=lambda r: r["LastWriteTimeUtc"])

    def _count_entries(self, m, values):
        for f in self.vars[m["list"]]:
            self.vars["total"] += f["Length"]
            self.vars["count"] += 1
            self.print(values[0] + f["Name"])

    def _trim_or_clear(self, m, values):
        """The clear/trim statement: oldest first, until the total is within the limit (trim) or all are
        gone (clear); a file Remove-Item left in place is neither counted nor printed. `-eq` compares
        strings case-insensitively."""
        clear, trim, trim_again, removed, space = values
        v = self.vars
        action = str(v["action"]).lower()
        if not (action == clear.lower() or (action == trim.lower() and v["total"] > v["limit"])):
            return
        for f in v[m["list"]]:
            if action == trim_again.lower() and v["total"] <= v["limit"]:
                break
            local = self.local_path(f["FullName"])
            with contextlib.suppress(OSError):
                local.unlink()
            if not local.exists():
                v["total"] -= f["Length"]
                v["count"] -= 1
                self.print(f"{removed}{f['Name']}{space}{f['Length']}")

    def _path_root(self, m, values):
        self.vars[m["var"]] = path_root(str(self.vars.get(m["a"]) or ""))

    def _drives(self, m, values):
        """Get-PSDrive -PSProvider FileSystem: a drive per letter folder of the PC (C:\\ ...), whose Free
        is its file system's free bytes (Win32_LogicalDisk's FreeSpace); Where-Object Root -eq (strings
        compare case-insensitively)."""
        found = None
        for folder in sorted(self.root.iterdir()):
            if re.fullmatch(r"[A-Z]", folder.name) and folder.is_dir():
                root = f"{folder.name}:\\"
                if root.lower() == str(self.vars.get(m["root"]) or "").lower():
                    stats = os.statvfs(folder)
                    found = {"Root": root, "Free": stats.f_bavail * stats.f_frsize}
        self.vars[m["var"]] = found

    def _print_free_kib(self, m, values):
        drive = self.vars.get(m["var"])
        if drive:
            self.print(f"{values[0]}{drive['Free'] // 1024}")

    FORMS = [
        (r"\[Console\]::Error\.WriteLine \( § \+ \$PID \)", _marker),
        (r"§", _literal),
        (
            r"Get-CimInstance -ClassName "
            r"(?P<cls>Win32_ComputerSystem|Win32_Processor|Win32_OperatingSystem|Win32_VideoController) "
            r"\| Select-Object (?P<props>[\w,]+) \| ConvertTo-Json -Compress",
            _cim,
        ),
        (
            r"if \( Get-Command nvidia-smi -ErrorAction SilentlyContinue \) \{ nvidia-smi "
            r"--query-gpu=index,name,memory\.total,memory\.free --format=csv,noheader,nounits \}",
            _nvidia,
        ),
        (
            r"if \( Get-Command vulkaninfo -ErrorAction SilentlyContinue \) \{ vulkaninfo --summary \}",
            _vulkaninfo,
        ),
        (
            r"Get-Command (?P<names>[\w.,+-]+) -ErrorAction SilentlyContinue \| "
            r"Select-Object -ExpandProperty "
            r"Source",
            _get_command_sources,
        ),
        (
            r"Get-NetTCPConnection -State Listen -LocalPort (?P<port>\d+) -ErrorAction SilentlyContinue \| "
            r"Select-Object LocalAddress,LocalPort,OwningProcess \| ConvertTo-Json -Compress",
            _listeners,
        ),
        (
            r"Get-CimInstance -ClassName Win32_Process -Filter § \| "
            r"Select-Object -ExpandProperty CommandLine",
            _process_cmdline,
        ),
        (
            r"if \( Get-Process -Id (?P<pid>\d+) -ErrorAction SilentlyContinue \) \{ exit (?P<yes>\d) \} "
            r"else \{ exit (?P<no>\d) \}",
            _alive_check,
        ),
        (r"Stop-Process -Id (?P<pid>\d+) -Force -ErrorAction SilentlyContinue", _stop),
        (r"Start-Sleep -Milliseconds (?P<ms>\d+)", _sleep),
        (
            r"Start-Process -FilePath §(?P<args> -ArgumentList §)?(?P<cwd> -WorkingDirectory §)? "
            r"-RedirectStandardOutput § -RedirectStandardError § -WindowStyle Hidden -PassThru"
            r"(?: -ErrorAction Stop)? \| Select-Object -ExpandProperty Id"
            r"(?P<pidfile> \| Out-File -LiteralPath § -Encoding ascii)?",
            _start_process,
        ),
        (r"& §( §)*", _native),
        (
            r"\( New-Item -ItemType Directory -Force -Path \( Join-Path \$env:USERPROFILE § \) \) \.FullName",
            _run_dir,
        ),
        (r"Get-Content -LiteralPath §( , §)* -Tail (?P<count>\d+) -ErrorAction SilentlyContinue", _tail),
        (
            r"\( New-Object System\.Net\.Sockets\.TcpClient \( § , (?P<port>\d+) \) \) \.Close \( \)",
            _connect,
        ),
        (r"Remove-Item -LiteralPath §( , §)* -Force -ErrorAction SilentlyContinue", _remove_item),
        (
            r"if \( Test-Path -LiteralPath § -PathType Leaf \) "
            r"\{ exit (?P<yes>\d) \} else \{ exit (?P<no>\d) \}",
            _test_path,
        ),
        (
            r"Invoke-CimMethod -ClassName Win32_Process -MethodName Create -Arguments "
            r"@ \{ CommandLine = § \} \| Select-Object -ExpandProperty ReturnValue",
            _wmi_create,
        ),
        (
            r"\( \[Security\.Principal\.WindowsPrincipal\]"
            r"\[Security\.Principal\.WindowsIdentity\]::GetCurrent \( \) \) "
            r"\.IsInRole \( \[Security\.Principal\.WindowsBuiltInRole\]::Administrator \)",
            _is_admin,
        ),
        (
            r"New-NetFirewallRule -DisplayName § -Direction Inbound -Protocol TCP -LocalPort (?P<port>\d+) "
            r"-RemoteAddress §( , §)* -Action (?P<action>Block|Allow) \| Out-Null",
            _new_firewall_rule,
        ),
        (
            r"Remove-NetFirewallRule -DisplayName §( , §)* -ErrorAction SilentlyContinue",
            _remove_firewall_rule,
        ),
        (r"\$env:(?P<name>\w+)", _env),
        (
            r"if \( Test-Path -LiteralPath \( Join-Path \$ \{ env:ProgramFiles \( x86 \) \} § \) "
            r"-PathType Leaf \) "
            r"\{ & \( Join-Path \$ \{ env:ProgramFiles \( x86 \) \} § \)( §)* \}",
            _vswhere,
        ),
        (r"New-Item -ItemType Directory -Force -Path § \| Out-Null", _new_dir),
        (r"Move-Item -LiteralPath § -Destination § -Force", _move),
        (r"Remove-Item -LiteralPath § -Recurse -Force -ErrorAction SilentlyContinue", _remove_tree),
        (r"\$env:(?P<name>\w+) = §", _set_env),
        (r"\$(?P<var>\w+) = §", _set_literal),
        (r"\$(?P<var>\w+) = (?:\[long\])?(?P<n>\d+)", _set_number),
        (r"if \( -not \$(?P<var>\w+) \) \{ \$(?P=var) = \$env:(?P<name>\w+) \}", _default_from_env),
        (
            r"if \( -not \$(?P<var>\w+) -and \$env:(?P<name>\w+) \) "
            r"\{ \$(?P=var) = \[IO\.Path\]::Combine \( \$env:(?P=name), § \) \}",
            _default_combined,
        ),
        (
            r"if \( \$(?P<var>\w+) -notmatch § \) \{ \[Console\]::Error\.WriteLine \( § \) ; "
            r"exit (?P<code>\d+) \}",
            _refuse_unless_match,
        ),
        (r"\$(?P<var>\w+) = \[IO\.Path\]::Combine \( \$(?P<a>\w+), § \)", _combine),
        (r"§ \+ \$(?P<var>\w+)", _concat),
        (
            r"\$(?P<out>\w+) = @ \( Get-ChildItem -LiteralPath \$(?P<var>\w+) -File -ErrorAction "
            r"SilentlyContinue \| Where-Object \{ \$_\.Name -cmatch § -and -not "
            r"\$_\.Attributes\.HasFlag \( \[IO\.FileAttributes\]::ReparsePoint \) \} \| "
            r"Sort-Object LastWriteTimeUtc \)",
            _list_files,
        ),
        (
            r"foreach \( \$f in \$(?P<list>\w+) \) \{ \$total \+= \$f\.Length ; \$count \+= 1 ; "
            r"§ \+ \$f\.Name \}",
            _count_entries,
        ),
        (
            r"if \( \$action -eq § -or \( \$action -eq § -and \$total -gt \$limit \) \) "
            r"\{ foreach \( \$f in \$(?P<list>\w+) \) \{ if \( \$action -eq § -and \$total -le \$limit \) "
            r"\{ break \} ; Remove-Item -LiteralPath \$f\.FullName -Force -ErrorAction SilentlyContinue ; "
            r"if \( -not \( Test-Path -LiteralPath \$f\.FullName \) \) \{ \$total -= \$f\.Length ; "
            r"\$count -= 1 ; § \+ \$f\.Name \+ § \+ \$f\.Length \} \} \}",
            _trim_or_clear,
        ),
        (r"\$(?P<var>\w+) = \[IO\.Path\]::GetPathRoot \( \$(?P<a>\w+) \)", _path_root),
        (
            r"\$(?P<var>\w+) = Get-PSDrive -PSProvider FileSystem \| "
            r"Where-Object \{ \$_\.Root -eq \$(?P<root>\w+) \}",
            _drives,
        ),
        (
            r"if \( \$(?P<var>\w+) \) \{ § \+ \[long\]\[Math\]::Floor \( \$(?P=var)\.Free / 1024 \) \}",
            _print_free_kib,
        ),
        (r"exit \$LASTEXITCODE", _exit_last),
        (r"exit (?P<code>\d+)", _exit),
    ]


def path_combine(first: str, second: str) -> str:
    """[IO.Path]::Combine on Windows: `second` when it is rooted, else the two joined by one backslash."""
    if re.match(r"[A-Za-z]:|[\\/]", second):
        return second
    if not first or first.endswith(("\\", "/", ":")):
        return first + second
    return f"{first}\\{second}"


def path_root(path: str) -> str:
    """[IO.Path]::GetPathRoot on Windows: C:\\ for a path on a drive, \\\\server\\share for one on a share."""
    if m := re.match(r"[A-Za-z]:[\\/]?", path):
        return m[0].replace("/", "\\")
    if m := re.match(r"[\\/]{2}[^\\/]+[\\/][^\\/]+", path):
        return m[0]
    return "\\" if path[:1] in ("\\", "/") else ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_command(host: Host, command: str) -> int:
    """One SSH exec request's command, as PowerShell (`-c <command>`) reads it."""
    tokens = tokenize(command)
    words = [t for t in tokens if t != "\n"]
    if words and words[0] in ("echo", "Write-Output"):
        host.print("\n".join(PSHOME if w == "$PSHOME" else str(w) for w in words[1:]))
        return 0
    if (
        len(words) == 5
        and [w.lower() for w in words[:4]]
        == ["powershell", "-noprofile", "-noninteractive", "-encodedcommand"]
        and not isinstance(words[4], Str)
    ):
        script = base64.b64decode(words[4], validate=True).decode("utf-16-le")
        return host.run_script(script)
    return host.run_script(command)


def serve_sftp(root: Path) -> int:
    """SFTP as Windows' OpenSSH serves it, absolute paths written /C:/Users/...: a real sftp-server, in a
    mount namespace of its own whose root holds the system's program folders and `C:`, the PC's C drive
    (the mounts end with the process), starting in the user's profile folder."""
    state = json.loads((root / "state.json").read_text())
    os.unshare(os.CLONE_NEWNS)
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    top = root / "sftp-root"
    top.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(top)], check=True)
    for name in ("usr", "lib", "lib64", "bin", "sbin", "etc", "dev"):
        system = Path("/") / name
        if system.is_symlink():
            (top / name).symlink_to(os.readlink(system))
        elif system.is_dir():
            (top / name).mkdir()
            subprocess.run(["mount", "--rbind", str(system), str(top / name)], check=True)
    (top / "C:").mkdir()
    subprocess.run(["mount", "--bind", str(root / "C"), str(top / "C:")], check=True)
    os.chroot(top)
    os.chdir("/")
    home = "/" + state["userprofile"].replace("\\", "/")
    os.execv(SFTP_SERVER, [SFTP_SERVER, "-d", home])
    return 1


def main() -> int:
    root = Path(sys.argv[1])
    command = os.environ.get("SSH_ORIGINAL_COMMAND")
    if command is None:
        sys.stderr.write("fake PowerShell: no interactive sessions\n")
        return 1
    if command == "internal-sftp":
        return serve_sftp(root)
    host = Host(root)
    try:
        return run_command(host, command)
    except PSError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    finally:
        host.close_job()


if __name__ == "__main__":
    sys.exit(main())
