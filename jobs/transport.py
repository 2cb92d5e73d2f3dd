"""The one interface through which the console acts on a node: SSH (jobs/ssh.py) or local (jobs/local.py).

Commands are argument lists. When one must become a shell string (SSH has no argv, and a daemon must be
detached with setsid/nohup), `shell_join` is the single place that quotes it.
"""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

StreamName = Literal["out", "err"]


class TransportError(Exception):
    """The node could not be reached or the command could not be started. The message is for people."""


class HostKeyUnknown(TransportError):
    """First contact: the node offered a host key that no admin has approved yet."""

    def __init__(self, message: str, *, offered_key: str, fingerprint: str):
        super().__init__(message)
        self.offered_key = offered_key
        self.fingerprint = fingerprint


class HostKeyChanged(TransportError):
    """The node offered a key different from the approved one: possible interception; block until approved."""

    def __init__(self, message: str, *, offered_key: str, fingerprint: str):
        super().__init__(message)
        self.offered_key = offered_key
        self.fingerprint = fingerprint


class CommandTimeout(TransportError):
    """A command ran longer than its timeout and was ended."""


@dataclass
class OutputLine:
    stream: StreamName
    text: str


@dataclass
class CommandResult:
    exit_status: int | None
    # Set when the process ended by a signal (e.g. "TERM", "KILL").
    signal: str | None = None
    lines: list[OutputLine] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    @property
    def stdout(self) -> str:
        return "\n".join(line.text for line in self.lines if line.stream == "out")


def shell_join(argv: Sequence[str]) -> str:
    """The only place an argument list becomes shell text."""
    return " ".join(shlex.quote(str(arg)) for arg in argv)


def decode_line(raw: bytes) -> str:
    """Text for storage and display: invalid UTF-8 replaced, NUL bytes dropped, line ending trimmed."""
    return raw.decode("utf-8", errors="replace").replace("\x00", "").rstrip("\r\n")


class Transport(Protocol):
    """What the runner needs from a node. Implementations are async context managers."""

    async def __aenter__(self) -> Transport: ...

    async def __aexit__(self, *exc) -> None: ...

    def stream(
        self, argv: Sequence[str], *, timeout: float | None = None, env: dict[str, str] | None = None
    ) -> AsyncIterator[OutputLine]:
        """Run argv; yield output lines as they come. After exhaustion, `last_result` holds the status."""
        ...

    @property
    def last_result(self) -> CommandResult | None: ...

    async def run(self, argv: Sequence[str], *, timeout: float | None = None, check: bool = False) -> CommandResult:
        """Run argv to completion and collect its output (for short commands)."""
        ...

    async def start_daemon(self, argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> int:
        """Start argv detached from the session (survives disconnect), output line-buffered to log_path.

        Returns the daemon's PID.
        """
        ...

    async def kill(self, pid: int, *, grace: float = 5.0) -> bool:
        """TERM the PID, wait up to `grace` seconds, then KILL. True when the process is gone."""
        ...

    async def pid_alive(self, pid: int) -> bool: ...

    async def upload(self, local_path: str, remote_path: str) -> None: ...

    async def read_head(self, remote_path: str, nbytes: int) -> bytes:
        """The first nbytes of a file on the node."""
        ...
