"""Find who listens on a port of a node, end it when it is a stale llama.cpp process of ours, never otherwise.

The listener tables of the three platforms are read by remote/listeners.py; the decision "ours or foreign"
is a pure function here. `reap_port` drives them through a transport: it ends our processes by PID (TERM,
wait, KILL) and confirms the port is free; a foreign holder is never touched and is reported by name. No
Django imports here.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from llamacpp.args import LLAMA_SERVER_BINARY, RPC_SERVER_BINARIES
from llamacpp.rpc_guard import TUNNEL_MARK
from remote.listeners import (
    Listener,
    holders_of,
    parse_get_nettcpconnection,
    parse_lsof,
    parse_ss,
    redact_cmdline,
)
from remote.powershell import cmdline_script, listeners_script, powershell_argv

# Executables the console starts. A process whose command line runs one of these is ours to reap.
OUR_PROGRAMS = {**dict.fromkeys(RPC_SERVER_BINARIES, "rpc-server"), LLAMA_SERVER_BINARY: "llama-server"}
# Wrappers that may stand in front of our program in a command line (`stdbuf -oL ggml-rpc-server ...`).
_WRAPPERS = {"stdbuf", "nohup", "setsid", "env", "nice", "taskset"}


@dataclass
class Holder:
    pid: int | None
    name: str
    cmdline: str
    kind: str | None  # "rpc-server", "llama-server" or None for a foreign process

    @property
    def ours(self) -> bool:
        return self.kind is not None

    def describe(self) -> str:
        who = f"PID {self.pid}" if self.pid is not None else "an unknown PID (another user's process?)"
        return f"{self.name or 'unknown program'} ({who}: {self.cmdline or 'command line not readable'})"


@dataclass
class ReapResult:
    port: int
    reaped: list[Holder] = field(default_factory=list)

    @property
    def summary(self) -> str:
        if not self.reaped:
            return f"port {self.port} was free"
        pids = ", ".join(f"{h.kind} PID {h.pid}" for h in self.reaped)
        return f"port {self.port}: reaped {pids}"


class ForeignHolder(Exception):
    """A process that is not ours holds the port. It is never killed; the message names it."""

    def __init__(self, port: int, holder: Holder):
        super().__init__(
            f"Port {port} is held by a process that is not ours: {holder.describe()}. Not touched."
        )
        self.port = port
        self.holder = holder


class PortStillBusy(Exception):
    """We ended every process we found, yet the port still does not come free."""


# --------------------------------------------------------------------------------------------------
# Parsing (pure)
# --------------------------------------------------------------------------------------------------


def program_of(cmdline: str) -> str:
    """The program a command line runs, past wrappers such as stdbuf, and without a directory or `.exe`."""
    # Windows paths carry backslashes, which POSIX quoting rules would eat.
    posix = "\\" not in cmdline
    try:
        words = shlex.split(cmdline, posix=posix)
    except ValueError:
        words = cmdline.split()
    for word in words:
        word = word.strip('"')
        if word.startswith("-") or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
            continue  # a wrapper's option (stdbuf -oL) or an environment assignment (env A=B prog)
        base = re.split(r"[\\/]", word)[-1]
        if base.lower().endswith(".exe"):
            base = base[:-4]
        if base in _WRAPPERS:
            continue
        return base
    return ""


def classify(cmdline: str) -> str | None:
    """ "rpc-server", "llama-server" or "rpc-tunnel" when the command line runs one of ours, else None
    (foreign). An ssh is ours only when it is a deployment's tunnel (its files carry the tunnel mark)."""
    program = program_of(cmdline)
    if program == "ssh":
        return "rpc-tunnel" if TUNNEL_MARK in cmdline and " -L " in f" {cmdline} " else None
    return OUR_PROGRAMS.get(program)


# --------------------------------------------------------------------------------------------------
# Commands per platform
# --------------------------------------------------------------------------------------------------


def listeners_argv(platform: str, port: int) -> list[str]:
    if platform == "windows":
        return powershell_argv(listeners_script(port))
    if platform == "macos":
        return ["lsof", "-nP", f"-iTCP:{int(port)}", "-sTCP:LISTEN"]
    return ["ss", "-Hltnp", f"sport = :{int(port)}"]


def parse_listeners(platform: str, text: str) -> list[Listener]:
    if platform == "windows":
        return parse_get_nettcpconnection(text)
    if platform == "macos":
        return parse_lsof(text)
    return parse_ss(text)


def cmdline_argv(platform: str, pid: int) -> list[str]:
    if platform == "windows":
        return powershell_argv(cmdline_script(pid))
    # -ww: the whole line; without it ps may cut it to the terminal width (80 columns when it has none).
    return ["ps", "-ww", "-o", "args=", "-p", str(int(pid))]


# --------------------------------------------------------------------------------------------------
# Driving a transport
# --------------------------------------------------------------------------------------------------

Log = Callable[[str], Awaitable[None]]


async def _quiet_log(text: str) -> None:
    return None


async def find_holders(transport, platform: str, port: int) -> list[Holder]:
    """Who listens on `port` of the node, each with its command line and whether it is ours.

    The command line is redacted here, once: it goes on to job logs, audit entries and pages, and a
    llama-server started by hand may carry `--api-key`.
    """
    result = await transport.run(listeners_argv(platform, port), timeout=30)
    holders = []
    for listener in holders_of(parse_listeners(platform, result.stdout), port):
        cmdline = ""
        if listener.pid is not None:
            ps = await transport.run(cmdline_argv(platform, listener.pid), timeout=30)
            cmdline = redact_cmdline(ps.stdout.strip())
        name = listener.name or program_of(cmdline)
        holders.append(Holder(listener.pid, name, cmdline, classify(cmdline) if cmdline else None))
    return holders


async def wait_port_free(transport, platform: str, port: int, *, timeout: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await transport.run(listeners_argv(platform, port), timeout=30)
        if not holders_of(parse_listeners(platform, result.stdout), port):
            return True
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.3)


async def reap_port(
    transport,
    platform: str,
    port: int,
    *,
    log: Log = _quiet_log,
    grace: float = 5.0,
    keep_pids: frozenset[int] = frozenset(),
) -> ReapResult:
    """End our stale processes on `port` by PID and confirm the port is free.

    Raises ForeignHolder (before killing anything) when any holder is not ours, and PortStillBusy when the
    port does not come free. `keep_pids` are processes of a running deployment that must survive.
    """
    outcome = ReapResult(port)
    holders = await find_holders(transport, platform, port)
    for holder in holders:
        if not holder.ours or holder.pid is None:
            raise ForeignHolder(port, holder)
    for holder in holders:
        if holder.pid in keep_pids:
            await log(f"port {port}: {holder.kind} PID {holder.pid} belongs to a running deployment; kept")
            continue
        await log(f"port {port}: stale {holder.kind} PID {holder.pid} ({holder.cmdline}); sending TERM")
        gone = await transport.kill(holder.pid, grace=grace)
        await log(f"port {port}: PID {holder.pid} {'ended' if gone else 'did NOT end'}")
        outcome.reaped.append(holder)
    if keep_pids and any(h.pid in keep_pids for h in holders):
        return outcome
    if not await wait_port_free(transport, platform, port):
        raise PortStillBusy(f"Port {port} is still in use after ending {len(outcome.reaped)} process(es).")
    await log(f"port {port}: free")
    return outcome


async def runs_our_program(transport, platform: str, pid: int, role: str) -> tuple[bool, str]:
    """Is `pid` still the `role` process we started? PIDs are reused: a process that ended long ago may
    have left its PID to something else, which must be neither killed nor taken for our server.
    Returns (ours, its command line)."""
    result = await transport.run(cmdline_argv(platform, pid), timeout=30)
    # Redacted here, where it is read: whatever a caller logs or shows of it carries no key.
    cmdline = redact_cmdline(result.stdout.strip())
    return bool(cmdline) and classify(cmdline) == role, cmdline
