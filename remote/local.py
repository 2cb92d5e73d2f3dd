"""The local transport: the console's own host, through asyncio subprocesses (no SSH needed).

Same interface and the same conventions as remote/ssh.py: argument lists (no shell except the one daemon
launcher built by `transport.daemon_script`), output lines streamed as they come, a timeout on every
command, each command in its own process group so an overrun ends all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator, Sequence

import psutil

from remote.base import (
    DEFAULT_OUTPUT_MAX_BYTES,
    EXIT_NOT_FOUND,
    Command,
    CommandResult,
    CommandTimeout,
    LinePump,
    OutputLine,
    TransportError,
    daemon_script,
    run_to_end,
)

DEFAULT_TIMEOUT_S = 3 * 3600.0

# What a command on the console's own host must not inherit from the console: its keys, its database and
# broker addresses (with their passwords), anything that looks like a credential. A build's CMakeLists,
# an rpc-server or curl has no use for them.
_SECRET_NAME = re.compile(r"SECRET|KEY|PASSWORD|PASSWD|TOKEN|CREDENTIAL|AUTH", re.I)
_DROPPED = frozenset({"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE"})


def scrubbed_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The console's environment without RAMDECK_*, credential-like variables and service URLs, plus
    `extra` (what a caller sets on purpose, e.g. a build's CC)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("RAMDECK_") and name not in _DROPPED and not _SECRET_NAME.search(name)
    }
    env.update(extra or {})
    return env


class LocalTransport:
    # The console's own host: no network between it and itself.
    rtt_ms: float | None = 0.0

    def __init__(self, *, command_timeout: float | None = None, output_limit: int | None = None) -> None:
        self.command_timeout = command_timeout or DEFAULT_TIMEOUT_S
        # Bytes of one command's output kept (remote.base.OutputBudget).
        self.output_limit = output_limit or DEFAULT_OUTPUT_MAX_BYTES

    async def __aenter__(self) -> LocalTransport:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    def command(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        input: bytes | None = None,
    ) -> Command:
        return Command(
            argv, lambda command: self._lines(command, timeout or self.command_timeout, env, input)
        )

    async def _lines(
        self, command: Command, timeout: float, env: dict[str, str] | None, input: bytes | None = None
    ) -> AsyncIterator[OutputLine]:
        argv = command.argv
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL if input is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=scrubbed_env(env),
                # Its own process group: a timeout or cancel ends the command and all its children.
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise TransportError(
                f"{argv[0]!r} was not found on this host (the console's own). Is it installed and on PATH?"
            ) from exc
        except PermissionError as exc:
            raise TransportError(f"{argv[0]!r} cannot be executed here: permission denied.") from exc
        command.pid = process.pid
        if input is not None:
            # Small (a curl config line): buffered by the pipe's transport, never blocking the output.
            process.stdin.write(input)
            process.stdin.close()
        pump = LinePump({"out": process.stdout, "err": process.stderr})
        finished = False
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(pump.next_batch(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    await self._end_group(process.pid, grace=2.0)
                    raise CommandTimeout(
                        f"{argv[0]!r} ran longer than {timeout:g} s and was ended."
                    ) from None
                if batch is None:
                    break
                for line in batch:
                    yield line
            try:
                await asyncio.wait_for(process.wait(), max(1.0, deadline - loop.time()))
            except TimeoutError:
                await self._end_group(process.pid, grace=2.0)
                raise CommandTimeout(f"{argv[0]!r} did not exit in time and was ended.") from None
            finished = True
            command.finished(_result_of(process.returncode, argv))
        finally:
            pump.close()
            if not finished and process.returncode is None:
                # The consumer gave up (cancelled or closed the stream): do not leave the command behind.
                await self._end_group(process.pid, grace=2.0)
                with contextlib.suppress(ProcessLookupError):
                    await process.wait()

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = False,
        input: bytes | None = None,
    ) -> CommandResult:
        return await run_to_end(self, argv, timeout=timeout, check=check, input=input)

    async def start_daemon(self, argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> int:
        # A launcher shell of its own, not a `Command`: it prints the daemon's PID and exits at once.
        launcher = await asyncio.create_subprocess_exec(
            "sh",
            "-c",
            daemon_script(argv, log_path=log_path, cwd=cwd),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=scrubbed_env(),
        )
        output, _ = await asyncio.wait_for(launcher.communicate(), 60)
        text = output.decode(errors="replace").strip()
        if launcher.returncode != 0:
            raise TransportError(f"Starting {argv[0]!r} failed: {text[-300:]}")
        try:
            return int(text.splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise TransportError(f"Starting {argv[0]!r} did not report a PID.") from exc

    async def kill(self, pid: int, *, grace: float = 5.0) -> bool:
        return await self._end_group(int(pid), grace=grace)

    async def pid_alive(self, pid: int) -> bool:
        return _alive(int(pid))

    async def upload(self, local_path: str, remote_path: str) -> None:
        try:
            await asyncio.to_thread(shutil.copyfile, local_path, remote_path)
        except OSError as exc:
            raise TransportError(
                f"Copying {local_path} to {remote_path} failed: {exc.strerror or exc}"
            ) from exc

    async def write_file(self, remote_path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write `data` (held in memory, e.g. a key) to a new file created with `mode`: no temporary copy
        anywhere, an old file at the path removed first, and an exclusive create that follows no link."""

        def write() -> None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(remote_path)
            fd = os.open(remote_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise TransportError(f"Writing {remote_path} failed: {exc.strerror or exc}") from exc

    async def read_range(self, remote_path: str, offset: int, nbytes: int) -> bytes:
        def read() -> bytes:
            with open(remote_path, "rb") as handle:
                handle.seek(offset)
                return handle.read(nbytes)

        try:
            return await asyncio.to_thread(read)
        except OSError as exc:
            raise TransportError(f"Reading {remote_path} failed: {exc.strerror or exc}") from exc

    async def write_at(self, remote_path: str, offset: int, data: bytes) -> None:
        def write() -> None:
            with open(remote_path, "wb" if offset == 0 else "r+b") as handle:
                handle.seek(offset)
                handle.write(data)

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise TransportError(f"Writing {remote_path} failed: {exc.strerror or exc}") from exc

    async def read_head(self, remote_path: str, nbytes: int) -> bytes:
        def read() -> bytes:
            with open(remote_path, "rb") as handle:
                return handle.read(nbytes)

        try:
            return await asyncio.to_thread(read)
        except OSError as exc:
            raise TransportError(f"Reading {remote_path} failed: {exc.strerror or exc}") from exc

    async def _end_group(self, pid: int, *, grace: float) -> bool:
        """TERM the process (its group when it leads one), wait up to `grace`, then KILL."""
        if not _alive(pid):
            return True
        _signal(pid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while _alive(pid) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
            for _ in range(40):
                if not _alive(pid):
                    break
                await asyncio.sleep(0.05)
        return not _alive(pid)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
            return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    """Running and not a zombie (a process nobody reaped is gone for every purpose here)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # Someone else's process, but it exists.
        return True


def _result_of(returncode: int | None, argv: Sequence[str]) -> CommandResult:
    if returncode is not None and returncode < 0:
        return CommandResult(exit_status=None, signal=signal.Signals(-returncode).name.removeprefix("SIG"))
    if returncode == EXIT_NOT_FOUND:
        raise TransportError(f"{argv[0]!r} reported exit status 127: a command it needs was not found.")
    return CommandResult(exit_status=returncode)
