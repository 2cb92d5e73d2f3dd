"""The SSH transport (asyncssh), with pinned host keys.

Host keys: no code path connects with host-key checking off. asyncssh is given an empty known-hosts list,
so every key it is offered goes through `_PinningClient.validate_host_public_key`, which accepts only the
key an admin approved. On first contact (no approved key) or when the key differs, the offered key is
captured and the connection is refused before authentication, so nothing runs on the node.

Every command is started as `echo <marker> $$ >&2; exec <argv>` so the transport learns the remote PID
(the shell `exec`s into the command, keeping its PID and its own process group: sshd makes each session a
new session leader) and can end a command that overruns its timeout by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import asyncssh

from remote import powershell
from remote.base import (
    DEFAULT_OUTPUT_MAX_BYTES,
    EXIT_NOT_FOUND,
    Command,
    CommandResult,
    CommandTimeout,
    HostKeyChanged,
    HostKeyUnknown,
    LinePump,
    OutputLine,
    TransportError,
    collect_lines,
    daemon_script,
    run_to_end,
    shell_join,
)

PID_MARKER = "__ramdeck_pid__"
_PID_LINE = re.compile(rf"^{PID_MARKER} (\d+)$")
# Output lines kept back while waiting for the PID marker, at most (then they flow without it).
_HOLD_LINES = 1000

# Fixed shell scripts; their inputs arrive as positional arguments ("$1", ...), never as formatted text.
_ALIVE = 'st=$(ps -o stat= -p "$1" 2>/dev/null) || exit 1; case "$st" in *Z*) exit 1;; esac; exit 0'
_KILL = (
    'alive() { st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1; case "$st" in *Z*) return 1;; esac; }\n'
    'alive "$1" || exit 0\n'
    'kill -TERM -- "-$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null\n'
    'i=0; while [ "$i" -lt "$2" ]; do alive "$1" || exit 0; sleep 0.1; i=$((i+1)); done\n'
    'kill -KILL -- "-$1" 2>/dev/null || kill -KILL "$1" 2>/dev/null\n'
    'sleep 0.2; alive "$1" && exit 1; exit 0\n'
)


@dataclass
class SSHTarget:
    """Where and how to connect. Secrets live here only for the lifetime of one transport."""

    host: str
    port: int = 22
    username: str = "root"
    password: str | None = None
    private_key: str | None = None
    passphrase: str | None = None
    # The approved host key ("ssh-ed25519 AAAA..."). Empty: first contact, nothing may run.
    pinned_host_key: str = ""
    connect_timeout: float = 10.0
    keepalive_interval: float = 15.0
    keepalive_count_max: int = 3
    command_timeout: float = 3 * 3600.0
    # Bytes of one command's output the console keeps (remote.base.OutputBudget).
    output_limit: int = DEFAULT_OUTPUT_MAX_BYTES
    # "posix" or "windows" when the node's platform is known; "" tells them apart at connect (the node's
    # first connection: nodes/transports.py).
    shell: str = "posix"

    @property
    def label(self) -> str:
        return f"{self.username}@{self.host}:{self.port}"


def key_fingerprint(key: asyncssh.SSHKey) -> str:
    return key.get_fingerprint("sha256")


def public_key_line(key: asyncssh.SSHKey) -> str:
    """The key in OpenSSH one-line form without a comment."""
    return " ".join(key.export_public_key("openssh").decode().split()[:2])


def fingerprint_of(openssh_line: str) -> str:
    """SHA256 fingerprint of an OpenSSH public key line (for display)."""
    return key_fingerprint(asyncssh.import_public_key(openssh_line))


class _PinningClient(asyncssh.SSHClient):
    def __init__(self, pinned: asyncssh.SSHKey | None) -> None:
        self.pinned = pinned
        self.offered: asyncssh.SSHKey | None = None
        self.lost: Exception | None = None
        self.closed = False

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self.offered = key
        return self.pinned is not None and key == self.pinned

    def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
        _acknowledge_promptly(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = exc


def _acknowledge_promptly(conn: asyncssh.SSHClientConnection) -> None:
    """Send TCP ACKs as soon as data is read instead of up to 40 ms later.

    Right after login, OpenSSH's sshd sends a few small messages (host-key list, debug notes) that need no
    answer, then the reply to our channel-open. It does not disable Nagle's algorithm for sessions without a
    terminal, so that reply waits until the earlier messages are acknowledged, and Linux delays that
    acknowledgement by up to 40 ms: the first command on most connections took ~45 ms instead of ~5 ms.
    Setting TCP_QUICKACK after each read sends any pending ACK at once (the kernel resets the flag itself,
    so it is set every time).
    """
    sock = conn.get_extra_info("socket")
    quickack = getattr(socket, "TCP_QUICKACK", None)  # Linux only; elsewhere the delay stays.
    if sock is None or quickack is None:
        return
    received = conn.data_received

    def data_received(data: bytes) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)
        received(data)

    conn.data_received = data_received


class SSHTransport:
    """Runs commands on one node over one SSH connection (opened by `async with`)."""

    def __init__(self, target: SSHTarget) -> None:
        self.target = target
        self.output_limit = target.output_limit
        self._conn: asyncssh.SSHClientConnection | None = None
        self._client: _PinningClient | None = None
        # Network round trip to the node, from the TCP handshake of this connection.
        self.rtt_ms: float | None = None
        # "posix" or "windows" (whose commands remote/powershell.py builds); which Windows shell answered.
        self.shell = target.shell
        self.windows_shell = ""

    # -- connection ----------------------------------------------------------------------------------

    async def __aenter__(self) -> SSHTransport:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        target = self.target
        pinned = asyncssh.import_public_key(target.pinned_host_key) if target.pinned_host_key else None
        client = _PinningClient(pinned)
        self._client = client
        try:
            sock = await self._open_socket()
            self._conn = await asyncio.wait_for(
                asyncssh.connect(
                    target.host,
                    target.port,
                    sock=sock,
                    client_factory=lambda: client,
                    # No trusted keys from any file: the pinning client decides about every offered key.
                    known_hosts=lambda host, addr, port: ([], [], []),
                    # Offer only the approved key's algorithms so the server presents that key type.
                    server_host_key_algs=[alg.decode() for alg in pinned.sig_algorithms]
                    if pinned
                    else "default",
                    username=target.username,
                    password=target.password,
                    client_keys=self._client_keys(),
                    passphrase=None,
                    agent_path=None,
                    config=None,
                    preferred_auth=["publickey"]
                    if target.private_key
                    else ["password", "keyboard-interactive"],
                    connect_timeout=target.connect_timeout,
                    login_timeout=target.connect_timeout,
                    keepalive_interval=target.keepalive_interval,
                    keepalive_count_max=target.keepalive_count_max,
                ),
                # asyncssh bounds each phase; this bounds the whole, in case a phase hangs.
                timeout=target.connect_timeout + 5,
            )
        except (asyncssh.Error, OSError, TimeoutError, TransportError) as exc:
            raise self._connect_error(exc, client) from exc
        if not self.shell:
            await self._detect_shell()

    async def _detect_shell(self) -> None:
        """First contact with a node of unknown platform: one line that cmd.exe, PowerShell and a POSIX sh
        each answer differently (remote/powershell.py's DETECT_COMMAND) tells which shell runs commands."""
        conn = self._require_conn()
        try:
            result = await asyncio.wait_for(
                conn.run(powershell.DETECT_COMMAND, check=False, stdin=asyncssh.DEVNULL), 30
            )
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            raise TransportError(f"{self.target.host}: telling its shell apart failed: {exc}") from exc
        stdout = result.stdout if isinstance(result.stdout, str) else ""
        found = powershell.shell_of(stdout)
        self.windows_shell = found if found in ("cmd", "powershell") else ""
        self.shell = "windows" if self.windows_shell else "posix"

    async def _open_socket(self) -> socket.socket:
        """The TCP connection, opened here so its handshake times the network round trip (`rtt_ms`):
        SYN to SYN-ACK involves no process on the node, unlike timing a command."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.target.connect_timeout
        infos = await asyncio.wait_for(
            loop.getaddrinfo(self.target.host, self.target.port, type=socket.SOCK_STREAM),
            self.target.connect_timeout,
        )
        error: Exception = OSError(f"no address for {self.target.host}")
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            started = time.perf_counter()
            try:
                await asyncio.wait_for(loop.sock_connect(sock, address), max(0.01, deadline - loop.time()))
            except (OSError, TimeoutError) as exc:
                sock.close()
                error = exc
                if isinstance(exc, TimeoutError):
                    break
                continue
            self.rtt_ms = round((time.perf_counter() - started) * 1000, 3)
            return sock
        raise error

    def _client_keys(self) -> list | None:
        if not self.target.private_key:
            return None
        try:
            key = asyncssh.import_private_key(self.target.private_key, self.target.passphrase or None)
        except (asyncssh.KeyImportError, ValueError) as exc:
            raise TransportError(
                f"The private key of the credential for {self.target.label} cannot be read ({exc}). "
                "Check the key and its passphrase."
            ) from exc
        return [key]

    def _connect_error(self, exc: Exception, client: _PinningClient) -> TransportError:
        t = self.target
        where = f"{t.host}:{t.port}"
        if isinstance(exc, TransportError):
            return exc
        if isinstance(exc, asyncssh.HostKeyNotVerifiable) and client.offered is not None:
            offered, fp = public_key_line(client.offered), key_fingerprint(client.offered)
            if client.pinned is None:
                return HostKeyUnknown(
                    f"{where} offered host key {fp}, which no admin has approved yet. Compare it with the "
                    "machine's own key (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub) and approve it on "
                    "the node page; nothing runs there until then.",
                    offered_key=offered,
                    fingerprint=fp,
                )
            return HostKeyChanged(
                f"The host key of {where} CHANGED: it now offers {fp}, but {key_fingerprint(client.pinned)} "
                "was approved. This can mean the machine was reinstalled or that someone is intercepting "
                "the connection. Every job on this node is blocked until an admin checks and approves the "
                "new key.",
                offered_key=offered,
                fingerprint=fp,
            )
        if isinstance(exc, asyncssh.KeyExchangeFailed) and client.pinned is not None:
            return TransportError(
                f"{where} no longer offers a host key of the approved type "
                f"({client.pinned.algorithm.decode()}): {exc.reason}. If the machine was reinstalled, an "
                "admin must clear and re-approve its key."
            )
        if isinstance(exc, asyncssh.PermissionDenied):
            how = "the private key" if t.private_key else "the password"
            return TransportError(
                f"{where} refused the login as {t.username!r} with {how}: wrong password, or the key is "
                "not in that user's authorized_keys. Check the node's user and credential."
            )
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            return TransportError(
                f"{where} did not answer within {t.connect_timeout:g} s. Is the machine on, on this network, "
                "and is the address right?"
            )
        if isinstance(exc, ConnectionRefusedError):
            return TransportError(
                f"{where} refused the connection: is sshd running and listening on port {t.port}?"
            )
        if isinstance(exc, socket.gaierror):
            return TransportError(
                f"The name {t.host!r} could not be resolved ({exc.strerror}). Check the address."
            )
        if isinstance(exc, OSError):
            return TransportError(
                f"Cannot reach {where}: {exc.strerror or exc}. Check the network and the address."
            )
        reason = exc.reason if isinstance(exc, asyncssh.DisconnectError) else str(exc)
        return TransportError(f"The SSH connection to {where} failed: {reason}")

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError, OSError, asyncssh.Error):
                await asyncio.wait_for(self._conn.wait_closed(), 5)
            self._conn = None

    def _require_conn(self) -> asyncssh.SSHClientConnection:
        if self._conn is None or (self._client is not None and self._client.closed):
            raise self._lost_error()
        return self._conn

    def _lost_error(self) -> TransportError:
        reason = self._client.lost if self._client else None
        detail = f" ({reason})" if reason else ""
        return TransportError(
            f"The connection to {self.target.host} was lost{detail}: the machine went away or the network "
            "dropped. The command's outcome on the node is unknown."
        )

    # -- a port of the node's loopback -----------------------------------------------------------------

    async def open_tunnel(self, port: int) -> tuple[asyncssh.SSHReader, asyncssh.SSHWriter]:
        """A TCP connection to 127.0.0.1:PORT made by the node's sshd and carried inside this SSH connection
        (what `ssh -L` forwards, with no listener on this side): a server that listens on the node's
        loopback only is reached without opening it to the network. sshd turns Nagle's algorithm off on
        the connection with its first command, and asyncssh on this side, so small answers travel at once,
        as through a deployment's `ssh -tt` tunnel (llamacpp/rpc_guard.py)."""
        conn = self._require_conn()
        try:
            return await conn.open_connection("127.0.0.1", int(port))
        except (asyncssh.Error, OSError) as exc:
            reason = exc.reason if isinstance(exc, asyncssh.Error) else str(exc)
            raise TransportError(
                f"{self.target.host}: sshd did not open a connection to its 127.0.0.1:{port}: {reason}"
            ) from exc

    # -- commands ----------------------------------------------------------------------------------------

    def _command_line(self, argv: Sequence[str], env: dict[str, str] | None) -> str:
        if self.shell == "windows":
            if env:
                raise TransportError(f"{argv[0]!r}: environment variables are not passed to a Windows node.")
            return powershell.command_line(argv)
        full = ["env", *(f"{k}={v}" for k, v in env.items()), *argv] if env else list(argv)
        return f"echo {PID_MARKER} $$ >&2; exec {shell_join(full)}"

    def command(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        input: bytes | None = None,
    ) -> Command:
        """A handle on argv; its `pid` is known once the command's first line (a PID marker) arrives."""
        return Command(argv, lambda command: self._guarded_lines(command, timeout, env, input))

    async def _guarded_lines(
        self, command: Command, timeout: float | None, env: dict[str, str] | None, input: bytes | None
    ) -> AsyncIterator[OutputLine]:
        # aclosing: when our consumer stops early, the inner generator's cleanup (ending the command by
        # PID) runs now, not whenever it is garbage-collected.
        async with contextlib.aclosing(self._lines(command, timeout, env, input)) as lines:
            async for line in lines:
                yield line

    async def _lines(
        self, command: Command, timeout: float | None, env: dict[str, str] | None, input: bytes | None = None
    ) -> AsyncIterator[OutputLine]:
        """The command's lines; its PID and result go to its own handle."""
        argv, running = command.argv, command
        conn = self._require_conn()
        timeout = timeout or self.target.command_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            if input is None:
                process = await conn.create_process(
                    self._command_line(argv, env), encoding=None, stdin=asyncssh.DEVNULL
                )
            else:
                # The input travels inside the SSH channel, never on the node's command line.
                process = await conn.create_process(self._command_line(argv, env), encoding=None)
                process.stdin.write(input)
                process.stdin.write_eof()
        except (asyncssh.Error, OSError) as exc:
            raise (
                self._lost_error()
                if self._client and self._client.closed
                else TransportError(f"Could not start {argv[0]!r} on {self.target.host}: {exc}")
            ) from exc
        pump = LinePump({"out": process.stdout, "err": process.stderr})
        finished = ended = False
        held: list[OutputLine] = []
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(pump.next_batch(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    await self._end_overrun(running.pid)
                    ended = True
                    raise CommandTimeout(
                        f"{argv[0]!r} on {self.target.host} ran longer than {timeout:g} s and was ended."
                    ) from None
                except (asyncssh.Error, OSError) as exc:
                    raise self._lost_error() from exc
                if batch is None:
                    break
                for line in batch:
                    if running.pid is None and line.stream == "err" and (m := _PID_LINE.match(line.text)):
                        running.pid = int(m.group(1))
                        # stdout and stderr travel separately: stdout that overtook the marker waits for it,
                        # so whoever reads a line can already end the command by PID.
                        for early in held:
                            yield early
                        held.clear()
                        continue
                    if running.pid is None:
                        if len(held) < _HOLD_LINES:
                            held.append(line)
                            continue
                        # The marker is unusually late: stop waiting for it, but never reorder output.
                        for early in held:
                            yield early
                        held.clear()
                    yield line
            for early in held:  # No marker came (an odd login shell): deliver what waited for it.
                yield early
            held.clear()
            try:
                await asyncio.wait_for(process.wait_closed(), max(1.0, deadline - loop.time()))
            except TimeoutError:
                await self._end_overrun(running.pid)
                ended = True
                raise CommandTimeout(f"{argv[0]!r} on {self.target.host} did not exit in time.") from None
            finished = True
            running.finished(self._result_of(process, argv))
        finally:
            pump.close()
            if not finished:
                process.close()
                if not ended and process.exit_status is None and process.exit_signal is None:
                    # The consumer stopped early (cancelled, or closed the stream): closing the channel
                    # does not end a command without a terminal, so end it by PID.
                    await self._end_overrun(running.pid)

    def _result_of(self, process: asyncssh.SSHClientProcess, argv: Sequence[str]) -> CommandResult:
        if process.exit_status is None and process.exit_signal is None:
            raise self._lost_error()
        signal_name = process.exit_signal[0] if process.exit_signal else None
        status = process.exit_status if process.exit_status is not None and process.exit_status >= 0 else None
        if status == EXIT_NOT_FOUND:
            raise TransportError(
                f"{argv[0]!r} was not found on {self.target.host} (exit status 127). Is it installed and on "
                f"the PATH of user {self.target.username!r}?"
            )
        return CommandResult(exit_status=status, signal=signal_name)

    async def _end_overrun(self, pid: int | None) -> None:
        """End a command that overran or was abandoned (its whole process group), if we know its PID."""
        if pid is not None and self._conn is not None and not (self._client and self._client.closed):
            with contextlib.suppress(TransportError, TimeoutError):
                await asyncio.wait_for(self.kill(pid, grace=2.0), 15)

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = False,
        input: bytes | None = None,
    ) -> CommandResult:
        where = f" on {self.target.host}"
        return await run_to_end(self, argv, timeout=timeout, check=check, where=where, input=input)

    async def _helper(self, argv: Sequence[str], *, timeout: float = 60) -> CommandResult:
        """Run a short helper command to completion (kill, pid_alive, start_daemon)."""
        command = Command(argv, lambda c: self._lines(c, timeout, None))
        lines = await collect_lines(command)
        result = command.result
        result.lines = lines
        return result

    async def _sh(self, script: str, *args: str | int, timeout: float = 60) -> CommandResult:
        return await self._helper(["sh", "-c", script, "sh", *(str(a) for a in args)], timeout=timeout)

    async def start_daemon(self, argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> int:
        if self.shell == "windows":
            return await self._start_on_windows(argv, log_path=log_path, cwd=cwd)
        result = await self._helper(["sh", "-c", daemon_script(argv, log_path=log_path, cwd=cwd)])
        if not result.ok:
            tail = "; ".join(line.text for line in result.lines[-3:])
            raise TransportError(f"Starting {argv[0]!r} on {self.target.host} failed: {tail}")
        try:
            return int(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise TransportError(f"Starting {argv[0]!r} on {self.target.host} did not report a PID.") from exc

    async def _start_on_windows(self, argv: Sequence[str], *, log_path: str, cwd: str | None) -> int:
        """remote/powershell.py's launch_script, then the PID from the file its Start-Process writes; a start
        that fails says why (WMI's return value, Start-Process's error, or the program's log files)."""
        script = powershell.launch_script(argv, log_path=log_path, cwd=cwd)
        program = powershell.split_env(argv)[1][0]  # its name in a message, not `env`
        result = await self._helper(powershell.powershell_argv(script))
        answer = result.stdout.strip().splitlines()[-1:] if result.ok else []
        if answer != ["0"]:
            said = answer[0] if answer else ""
            if not said:
                tail = "; ".join(line.text for line in result.lines[-3:]) or f"exit {result.exit_status}"
                raise TransportError(f"Starting {program!r} on {self.target.host} failed: {tail}")
            raise TransportError(powershell.start_failure(program, self.target.host, answer=said))
        read_pid = powershell.powershell_argv(powershell.tail_script([powershell.pid_file(log_path)], 20))
        deadline = asyncio.get_running_loop().time() + 15
        while asyncio.get_running_loop().time() < deadline:
            text = (await self._helper(read_pid)).stdout.strip()
            if text.isdigit():
                return int(text)
            if text.startswith(powershell.START_ERROR):
                raise TransportError(powershell.start_failure(program, self.target.host, pid_text=text))
            await asyncio.sleep(0.2)
        tails = powershell.tail_script([log_path, log_path + ".err"], 10)
        logs = await self._helper(powershell.powershell_argv(tails))
        lines = "\n".join(line.text for line in logs.lines if line.stream == "out")
        raise TransportError(powershell.start_failure(program, self.target.host, logs=lines))

    async def kill(self, pid: int, *, grace: float = 5.0) -> bool:
        if self.shell == "windows":
            result = await self._helper(powershell.powershell_argv(powershell.stop_script(pid)), timeout=60)
            return result.exit_status == 0
        ticks = max(1, int(grace * 10))
        result = await self._sh(_KILL, int(pid), ticks, timeout=grace + 30)
        return result.exit_status == 0

    async def pid_alive(self, pid: int) -> bool:
        if self.shell == "windows":
            result = await self._helper(powershell.powershell_argv(powershell.alive_script(pid)))
            return result.exit_status == 0
        return (await self._sh(_ALIVE, int(pid))).exit_status == 0

    # -- files -------------------------------------------------------------------------------------------

    def _sftp_path(self, remote_path: str) -> str:
        return powershell.sftp_path(remote_path) if self.shell == "windows" else remote_path

    async def upload(self, local_path: str, remote_path: str) -> None:
        conn = self._require_conn()
        try:
            async with conn.start_sftp_client() as sftp:
                await sftp.put(local_path, self._sftp_path(remote_path))
        except asyncssh.SFTPError as exc:
            raise TransportError(
                f"Uploading to {self.target.host}:{remote_path} failed: {exc.reason}"
            ) from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"Uploading to {self.target.host}:{remote_path} failed: {exc}") from exc

    async def write_file(self, remote_path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write `data` (held in memory, e.g. a key) to a new file on the node over SFTP, created with
        `mode` (the server's umask can only narrow it): an old file at the path is removed first, so the
        file never had a wider mode, and the create is exclusive, so a link planted there is not followed."""
        conn = self._require_conn()
        remote_path = self._sftp_path(remote_path)
        try:
            async with conn.start_sftp_client() as sftp:
                with contextlib.suppress(asyncssh.SFTPNoSuchFile):
                    await sftp.remove(remote_path)
                attrs = asyncssh.SFTPAttrs(permissions=mode)
                async with sftp.open(remote_path, "xb", attrs) as handle:
                    await handle.write(data)
        except asyncssh.SFTPError as exc:
            raise TransportError(f"Writing {self.target.host}:{remote_path} failed: {exc.reason}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"Writing {self.target.host}:{remote_path} failed: {exc}") from exc

    async def remote_forward_granted(self, listen: str | tuple[str, int]) -> bool:
        """Whether the node's sshd grants this login a remote forward: a Unix socket at the path `listen`
        (`ssh -R /path.sock:...`), or a TCP (host, port). A granted one is closed at once; nothing that
        connects in between reaches anything (its destination is a socket that does not exist)."""
        conn = self._require_conn()
        try:
            if isinstance(listen, str):
                listener = await conn.forward_remote_path(listen, "/nonexistent/ramdeck-probe.sock")
            else:
                listener = await conn.forward_remote_port(listen[0], listen[1], "127.0.0.1", 9)
        except asyncssh.ChannelListenError:
            return False
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"Asking {self.target.host} for a remote forward failed: {exc}") from exc
        if listener is None:
            return False
        listener.close()
        await listener.wait_closed()
        return True

    async def read_range(self, remote_path: str, offset: int, nbytes: int) -> bytes:
        conn = self._require_conn()
        try:
            async with conn.start_sftp_client() as sftp, sftp.open(remote_path, "rb") as handle:
                return await handle.read(nbytes, offset)
        except asyncssh.SFTPError as exc:
            raise TransportError(f"Reading {self.target.host}:{remote_path} failed: {exc.reason}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"Reading {self.target.host}:{remote_path} failed: {exc}") from exc

    async def write_at(self, remote_path: str, offset: int, data: bytes) -> None:
        conn = self._require_conn()
        try:
            mode = "wb" if offset == 0 else "r+b"
            async with conn.start_sftp_client() as sftp, sftp.open(remote_path, mode) as handle:
                await handle.write(data, offset)
        except asyncssh.SFTPError as exc:
            raise TransportError(f"Writing {self.target.host}:{remote_path} failed: {exc.reason}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"Writing {self.target.host}:{remote_path} failed: {exc}") from exc

    async def read_head(self, remote_path: str, nbytes: int) -> bytes:
        conn = self._require_conn()
        try:
            async with (
                conn.start_sftp_client() as sftp,
                sftp.open(self._sftp_path(remote_path), "rb") as handle,
            ):
                return await handle.read(nbytes)
        except asyncssh.SFTPError as exc:
            raise TransportError(f"Reading {self.target.host}:{remote_path} failed: {exc.reason}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"Reading {self.target.host}:{remote_path} failed: {exc}") from exc
