"""The one interface through which the console acts on a node: SSH (remote/ssh.py) or local (remote/local.py).

Commands are argument lists. When one must become a shell string (SSH has no argv, and a daemon must be
detached with setsid/nohup), `shell_join` is the single place that quotes it.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import AsyncIterator, Callable, Sequence
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
    refuse_nul(argv)
    return " ".join(shlex.quote(str(arg)) for arg in argv)


def refuse_nul(argv: Sequence[str]) -> None:
    """No command line can carry a NUL (C strings end there; a remote shell would run a truncated line)."""
    for index, arg in enumerate(argv):
        if "\x00" in str(arg):
            raise ValueError(f"Argument {index} of {str(argv[0])[:80]!r} contains a NUL character; not run.")


def decode_line(raw: bytes) -> str:
    """Text for storage and display: invalid UTF-8 replaced, NUL bytes dropped, line ending trimmed."""
    return raw.decode("utf-8", errors="replace").replace("\x00", "").rstrip("\r\n")


class Command:
    """One command on a node, as a transport hands it out: `lines()` runs it and yields its output as it
    comes; `pid` is its PID on the node once known (a canceller ends it by PID); `result` is its exit
    status once `lines()` has been read to the end.

    Each command carries its own bookkeeping, so helper commands (kill, pid_alive) that run while another
    command streams never disturb it.
    """

    def __init__(self, argv: Sequence[str], run: Callable[[Command], AsyncIterator[OutputLine]]) -> None:
        if not argv:
            raise ValueError("empty command")
        refuse_nul(argv)
        self.argv = [str(arg) for arg in argv]
        self.pid: int | None = None
        self._result: CommandResult | None = None
        self._run = run
        self._started = False

    def lines(self) -> AsyncIterator[OutputLine]:
        """Start the command and yield its lines; stopping early (closing the iterator) ends it."""
        if self._started:
            raise RuntimeError(f"{self.argv[0]!r}: a command's lines can be read only once.")
        self._started = True
        return self._run(self)

    @property
    def running(self) -> bool:
        return self._started and self._result is None

    @property
    def result(self) -> CommandResult:
        if self._result is None:
            raise RuntimeError(f"{self.argv[0]!r} has not ended yet: read its lines() to the end first.")
        return self._result

    def finished(self, result: CommandResult) -> None:
        """For transports: the command ended with `result`."""
        self._result = result


class Transport(Protocol):
    """What the runner needs from a node. Implementations are async context managers."""

    # Network round trip to the node in ms when the transport measured it while connecting (SSH times
    # its TCP handshake); 0.0 for the console's own host; None when unknown.
    rtt_ms: float | None

    async def __aenter__(self) -> Transport: ...

    async def __aexit__(self, *exc) -> None: ...

    def command(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        input: bytes | None = None,
    ) -> Command:
        """A handle on argv; nothing runs until its `lines()` are read. `input` is written to the command's
        standard input, which is then closed (a value that must not appear on a command line, where `ps`
        shows it: a download URL with its token); without it the command reads an empty input."""
        ...

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = False,
        input: bytes | None = None,
    ) -> CommandResult:
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

    async def write_file(self, remote_path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write `data` from memory to a new file on the node, created with `mode` (secrets never pass
        through a temporary file on the console's host)."""
        ...

    async def read_head(self, remote_path: str, nbytes: int) -> bytes:
        """The first nbytes of a file on the node."""
        ...

    async def read_range(self, remote_path: str, offset: int, nbytes: int) -> bytes:
        """At most nbytes of a file on the node, from byte `offset` (fewer at its end)."""
        ...

    async def write_at(self, remote_path: str, offset: int, data: bytes) -> None:
        """Write `data` into a file on the node at byte `offset`: a new file (or one emptied) when `offset` is
        0, else the existing one continued (a copy resumed where it stopped)."""
        ...


class CommandFailed(Exception):
    """`run(..., check=True)`: the command ran and exited non-zero (a job failure, not a transport error)."""

    def __init__(self, message: str, result: CommandResult):
        super().__init__(message)
        self.result = result


# A line longer than this is cut where it reaches it (the rest of it, up to its newline, is counted and
# dropped): a node that prints without newlines cannot make the console hold its output as one line.
MAX_LINE_BYTES = 64 * 1024
# What one command's output may leave in the console unless settings say otherwise
# (RAMDECK_COMMAND_OUTPUT_MAX_BYTES): see OutputBudget.
DEFAULT_OUTPUT_MAX_BYTES = 16 * 2**20


def cut_note(dropped: int) -> str:
    return f" … [{dropped} more bytes of this line cut]"


class LineSplitter:
    """Cuts a byte stream into decoded lines; a trailing partial line waits for more data or `flush`.
    A line longer than `max_line` bytes keeps its first `max_line` bytes and says how many were cut."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self.max_line = max_line
        self._pending = bytearray()
        self._dropped = 0

    def feed(self, chunk: bytes) -> list[str]:
        parts = chunk.split(b"\n")
        self._take(parts[0])
        if len(parts) == 1:
            return []
        lines = [self._line()]
        for part in parts[1:-1]:  # whole lines within this chunk
            if len(part) <= self.max_line:
                lines.append(decode_line(part))
            else:
                lines.append(decode_line(part[: self.max_line]) + cut_note(len(part) - self.max_line))
        self._take(parts[-1])
        return lines

    def flush(self) -> list[str]:
        return [self._line()] if self._pending or self._dropped else []

    def _take(self, piece: bytes) -> None:
        room = max(0, self.max_line - len(self._pending))
        self._pending += piece[:room]
        self._dropped += max(0, len(piece) - room)

    def _line(self) -> str:
        text = decode_line(bytes(self._pending))
        if self._dropped:
            text += cut_note(self._dropped)
        self._pending.clear()
        self._dropped = 0
        return text


class OutputBudget:
    """How much of one command's output the console keeps (collected for parsing, or written to a job's
    log): lines until `limit` bytes, then none; the rest is counted, and `note` says what was not kept.
    The command itself runs on to its end (its output is read and dropped, so it never blocks on a pipe)."""

    def __init__(self, limit: int = DEFAULT_OUTPUT_MAX_BYTES) -> None:
        self.limit = int(limit)
        self.kept = 0
        self.dropped_bytes = 0
        self.dropped_lines = 0

    def keep(self, line: OutputLine) -> bool:
        size = len(line.text.encode("utf-8", "replace")) + 1
        if not self.dropped_lines and self.kept + size <= self.limit:
            self.kept += size
            return True
        self.dropped_lines += 1
        self.dropped_bytes += size
        return False

    @property
    def truncated(self) -> bool:
        return self.dropped_lines > 0

    def note(self) -> str:
        return (
            f"[output truncated after {self.kept} bytes (at most {self.limit} are kept of one command, "
            f"RAMDECK_COMMAND_OUTPUT_MAX_BYTES): {self.dropped_bytes} more bytes in {self.dropped_lines} "
            "lines were not kept]"
        )


# Exit status a POSIX shell uses for "command not found"; transports turn it into a TransportError.
EXIT_NOT_FOUND = 127


class LinePump:
    """Reads stdout and stderr concurrently and hands out batches of lines in arrival order.

    A bounded queue gives backpressure: a slow consumer slows the readers instead of growing memory.
    `next_batch` is cancel-safe, so callers can bound it with `asyncio.wait_for`.
    """

    _DONE = object()

    def __init__(self, readers: dict[StreamName, object], *, chunk_size: int = 65536) -> None:
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._open = len(readers)
        self._tasks = [
            asyncio.create_task(self._pump(name, reader, chunk_size)) for name, reader in readers.items()
        ]

    async def _pump(self, name: StreamName, reader, chunk_size: int) -> None:
        splitter = LineSplitter()
        try:
            while chunk := await reader.read(chunk_size):
                if lines := splitter.feed(chunk):
                    await self._queue.put([OutputLine(name, text) for text in lines])
            if rest := splitter.flush():
                await self._queue.put([OutputLine(name, text) for text in rest])
        except Exception as exc:  # Handed to the consumer, which raises it in its own task.
            await self._queue.put(exc)
        await self._queue.put(self._DONE)

    async def next_batch(self) -> list[OutputLine] | None:
        """The next lines, or None when both streams have ended."""
        while self._open:
            item = await self._queue.get()
            if item is self._DONE:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                raise item
            return item
        return None

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


def daemon_script(argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> str:
    """Shell text that starts argv detached and prints its PID; for any POSIX sh on Linux and macOS.

    setsid (a session of its own, so it outlives the session that started it) and stdbuf -oL (stdout
    line-buffered, so its log can be read as it is written) are used only where they exist: stock macOS
    has neither. nohup, and `trap '' HUP` (inherited by the child from the fork on), keep SIGHUP from
    ending it either way. Under `&` in a shell without job control the child is no group leader, so
    setsid, nohup and stdbuf each exec in place and `$!` is the program's own PID. The `cd` is a
    statement of its own: `cd DIR && X &` would put the whole list in a subshell, and bash would
    report that subshell's PID.
    """
    lines = [f"{shell_join(['cd', cwd])} || exit 1"] if cwd else []
    lines += [
        "trap '' HUP",
        "set -- nohup",
        'command -v setsid >/dev/null 2>&1 && set -- setsid "$@"',
        'command -v stdbuf >/dev/null 2>&1 && set -- "$@" stdbuf -oL',
        f'"$@" {shell_join(argv)} > {shell_join([log_path])} 2>&1 < /dev/null &',
        "echo $!",
    ]
    return "\n".join(lines)


async def collect_lines(command: Command, limit: int = DEFAULT_OUTPUT_MAX_BYTES) -> list[OutputLine]:
    """A command's output lines, read to its end, at most `limit` bytes of them (then a note)."""
    budget = OutputBudget(limit)
    lines = [line async for line in command.lines() if budget.keep(line)]
    if budget.truncated:
        lines.append(OutputLine("err", budget.note()))
    return lines


async def run_to_end(
    transport: Transport,
    argv: Sequence[str],
    *,
    timeout: float | None,
    check: bool,
    where: str = "",
    input: bytes | None = None,
) -> CommandResult:
    """`Transport.run` for every transport: stream argv to its end, collect the lines, check the status.

    `where` (" on HOST") makes the failure message say which node it was.
    """
    command = transport.command(argv, timeout=timeout, input=input)
    lines = await collect_lines(command, getattr(transport, "output_limit", DEFAULT_OUTPUT_MAX_BYTES))
    result = command.result
    result.lines = lines
    if check and not result.ok:
        tail = "; ".join(line.text for line in lines[-3:] if line.text)
        raise CommandFailed(
            f"{argv[0]!r}{where} failed with exit status {result.exit_status}"
            + (f": {tail}" if tail else ""),
            result,
        )
    return result
