"""Who listens on a TCP port, read from the tools each platform has; and command lines made safe to show.

Pure functions, no Django: the hardware probe (nodes/probe/parse.py) and the reaper (llamacpp/reaper.py) both
read `ss -ltnp` (Linux, with or without the header line), `lsof -nP -iTCP:PORT -sTCP:LISTEN` (macOS, and
Linux without ss) and `Get-NetTCPConnection` as JSON (Windows) through these parsers.

`redact_cmdline` hides secrets a process was started with (`llama-server --api-key X` started by hand):
a command line read from a node may end up in a job log, an audit entry or a page.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Listener:
    """A process listening on a TCP port. `pid` is None when the tool could not tell (another user)."""

    address: str
    port: int
    pid: int | None
    name: str = ""


_SS_USERS = re.compile(r'\("(?P<name>[^"]*)",pid=(?P<pid>\d+)')


def _split_host_port(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def parse_ss(text: str) -> list[Listener]:
    """Listeners from `ss -ltnp` (with or without the header line, `-H`)."""
    result = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[0] != "LISTEN":
            continue
        local = _split_host_port(parts[3])
        if local is None:
            continue
        users = _SS_USERS.findall(line)
        if not users:
            result.append(Listener(local[0], local[1], None))
        for name, pid in users:
            result.append(Listener(local[0], local[1], int(pid), name))
    return _unique(result)


def parse_lsof(text: str) -> list[Listener]:
    """Listeners from `lsof -nP -iTCP:PORT -sTCP:LISTEN` (macOS, and Linux when ss is missing)."""
    result = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 9 or parts[0] == "COMMAND" or "(LISTEN)" not in line:
            continue
        name_idx = parts.index("(LISTEN)") - 1
        local = _split_host_port(parts[name_idx])
        if local is None or not parts[1].isdigit():
            continue
        # lsof escapes spaces in command names as \x20 and truncates them to 9 characters.
        result.append(Listener(local[0], local[1], int(parts[1]), parts[0].replace("\\x20", " ")))
    return _unique(result)


def parse_get_nettcpconnection(text: str) -> list[Listener]:
    """Listeners from `Get-NetTCPConnection -State Listen | Select LocalAddress,LocalPort,OwningProcess |
    ConvertTo-Json` (a single object when there is one row)."""
    text = text.strip()
    if not text:
        return []
    data = json.loads(text)
    rows = data if isinstance(data, list) else [data]
    result = []
    for row in rows:
        pid = row.get("OwningProcess")
        result.append(
            Listener(str(row.get("LocalAddress", "")), int(row["LocalPort"]), int(pid) if pid else None)
        )
    return _unique(result)


def _unique(listeners: list[Listener]) -> list[Listener]:
    seen: dict[tuple, Listener] = {}
    for item in listeners:
        seen.setdefault((item.address, item.port, item.pid), item)
    return list(seen.values())


def holders_of(listeners: list[Listener], port: int) -> list[Listener]:
    """One entry per PID that listens on `port` (IPv4 and IPv6 sockets of one process count once)."""
    by_pid: dict[int | None, Listener] = {}
    for item in listeners:
        if item.port == port:
            by_pid.setdefault(item.pid, item)
    return list(by_pid.values())


# Options whose value is a secret (llama.cpp's, and the usual spellings elsewhere), as "--opt X" or
# "--opt=X"; environment assignments such as `env LLAMA_API_KEY=X prog`; and the "api_key: X" that
# llama-server prints in its own log.
_SECRET_OPTION = re.compile(
    r"(?P<opt>(?<!\S)(?:--api-key|--hf-token|-hft|--password|--passwd|--token|--secret)(?:=|\s+))"
    r"(?P<value>\"[^\"]*\"|'[^']*'|\S+)",
    re.IGNORECASE,
)
_SECRET_ENV = re.compile(
    r"(?P<opt>(?<!\S)\w*(?:API_KEY|TOKEN|PASSWORD|SECRET)\w*=)(?P<value>\S+)", re.IGNORECASE
)
_SECRET_LOGGED = re.compile(r"(?P<opt>\bapi_keys?:\s*)(?P<value>\S+)", re.IGNORECASE)
HIDDEN = "(hidden)"


def redact_cmdline(text: str) -> str:
    """`text` with the values of secret options replaced by "(hidden)"; everything else unchanged."""
    for pattern in (_SECRET_OPTION, _SECRET_ENV, _SECRET_LOGGED):
        text = pattern.sub(lambda m: m["opt"] + HIDDEN, text)
    return text
