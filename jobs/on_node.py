"""What job bodies do on their node through `ctx.transport`, whatever the job: the run folder, a log's
tail, waiting for a listener, reading an rpc-server's banner, and writing a secret file the node alone can
read.

Every command here is one a stock macOS has as well as Linux (no `timeout`, `stdbuf`, `setsid` or `ss`):
tests/lab/test_mac_tools_lab.py runs them on a lab host whose PATH holds only the POSIX and BSD tools."""

from __future__ import annotations

import asyncio
import ntpath
import posixpath
import secrets

from jobs.context import JobFailed
from llamacpp.logs import parse_rpc_banner
from llamacpp.reaper import find_holders
from remote.listeners import redact_cmdline
from remote.powershell import connect_script, powershell_argv, remove_script, run_dir_script, tail_script

# Opens one TCP connection and closes it: perl and its IO::Socket::INET ship with stock macOS and with every
# Linux distribution's base system (Debian's perl-base is essential), where `nc` and bash's /dev/tcp may not.
_CONNECT = (
    "use IO::Socket::INET; "
    "IO::Socket::INET->new(PeerAddr => $ARGV[0], PeerPort => $ARGV[1], Proto => 'tcp', Timeout => 5) "
    "or exit 1"
)
# How long reading an rpc-server's banner may take before it is given up.
BANNER_TIMEOUT_S = 20.0


def on_windows(ctx) -> bool:
    return getattr(ctx.transport, "shell", "posix") == "windows"


def join(ctx, *parts: str) -> str:
    """A path on the node: backslashes on Windows."""
    return (ntpath if on_windows(ctx) else posixpath).join(*parts)


async def run_dir(ctx) -> str:
    """~/.ramdeck/run on the node (%USERPROFILE%\\.ramdeck\\run on Windows): logs and key files of the
    processes the console starts."""
    if on_windows(ctx):
        result = await ctx.transport.run(powershell_argv(run_dir_script()), timeout=30, check=True)
        return result.stdout.strip().splitlines()[-1]
    home = (await ctx.transport.run(["printenv", "HOME"], timeout=30)).stdout.strip() or "/tmp"
    path = posixpath.join(home, ".ramdeck", "run")
    await ctx.transport.run(["mkdir", "-p", path], timeout=30)
    return path


def remove_argv(ctx, log_path: str) -> list[str]:
    """Removes a detached program's log (on Windows also its .err and .pid files)."""
    if on_windows(ctx):
        return powershell_argv(remove_script([log_path, log_path + ".err", log_path + ".pid"]))
    return ["rm", "-f", log_path]


def tail_argv(transport, path: str, count: int) -> list[str]:
    """The command that prints a log's last lines on the node behind `transport`: `tail` on POSIX,
    PowerShell's Get-Content -Tail on Windows, where a detached program's stderr has a file of its own
    (path.err)."""
    if getattr(transport, "shell", "posix") == "windows":
        return powershell_argv(tail_script([path, path + ".err"], count))
    return ["tail", "-n", str(int(count)), path]


async def tail_lines(ctx, path: str, count: int = 20) -> list[str]:
    """The log's last lines; on Windows a detached program's stderr has a file of its own (path.err)."""
    result = await ctx.transport.run(tail_argv(ctx.transport, path, count), timeout=30)
    return [line.text for line in result.lines if line.stream == "out"]


async def wait_listening(ctx, pid: int, port: int, log_path: str, *, timeout: float) -> None:
    """Until `pid` listens on `port` on the node. An rpc-server given a bad option prints usage and exits
    with status 0, so "alive and listening" is the test, never the exit status."""
    platform = ctx.node.platform
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        holders = await find_holders(ctx.transport, platform, port)
        if any(h.pid == pid for h in holders):
            return
        others = [h for h in holders if h.pid != pid]
        if not await ctx.transport.pid_alive(pid):
            tail = "\n".join(await tail_lines(ctx, log_path))
            held = f" Port {port} is held by {others[0].describe()}." if others else ""
            raise JobFailed(
                f"PID {pid} exited before listening on port {port}.{held} Last log lines:\n{tail}"
            )
        if asyncio.get_running_loop().time() >= deadline:
            raise JobFailed(f"PID {pid} is alive but did not listen on port {port} within {timeout:g} s")
        await asyncio.sleep(0.3)


def connect_argv(host: str, port: int) -> list[str]:
    return ["perl", "-e", _CONNECT, host, str(int(port))]


def banner_complete(text: str) -> bool:
    """Whether a log holds an rpc-server's whole banner: its version line through its transport line, the
    last it prints before it listens."""
    banner = parse_rpc_banner(text)
    return bool(banner["version"] and banner["transport"])


async def flush_banner(ctx, pid: int, host: str, port: int, log_path: str) -> str:
    """The rpc-server's log once its banner is in it.

    ggml-rpc-server prints its banner with printf and flushes stdout only when a client connects. Where the
    node has `stdbuf` (GNU coreutils) the daemon runs line-buffered and the banner is in the log as soon as
    the server listens; stock macOS has no stdbuf, so the banner sits in the process's buffer. One
    connection from the node itself (closed at once: the server logs it and waits for the next) makes it
    write the banner out."""
    text = "\n".join(await tail_lines(ctx, log_path, 60))
    if banner_complete(text):
        return text
    await ctx.log(
        f"the rpc-server's banner is not in its log yet (no stdbuf here to line-buffer it): one connection "
        f"to {host}:{port} makes it write it out"
    )
    connect = powershell_argv(connect_script(host, port)) if on_windows(ctx) else connect_argv(host, port)
    await ctx.transport.run(connect, timeout=30)
    deadline = asyncio.get_running_loop().time() + 5
    while not banner_complete(text) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        text = "\n".join(await tail_lines(ctx, log_path, 60))
    return text


async def read_rpc_banner(ctx, rpc_path: str) -> str:
    """Start `rpc_path` once on the node's loopback (a random high port), read its banner, end it by PID.

    The banner is the only place an installed rpc-server states its protocol, its devices and their free
    memory. The server runs detached like any daemon of ours (its PID recorded on the job, so a cancel ends
    it); the banner is read from its log once it is written (see flush_banner), which a server that exits at
    once (a bad build) or never listens also ends."""
    directory = await run_dir(ctx)
    port = 40000 + secrets.randbelow(20000)
    log_path = join(ctx, directory, f"banner-{ctx.job.pk}-{port}.log")
    pid = await ctx.start_daemon([rpc_path, "-H", "127.0.0.1", "-p", str(port)], log_path=log_path)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BANNER_TIMEOUT_S
    text = ""
    try:
        while loop.time() < deadline:
            text = "\n".join(await tail_lines(ctx, log_path, 60))
            if banner_complete(text):
                break
            holders = await find_holders(ctx.transport, ctx.node.platform, port)
            if any(h.pid == pid for h in holders):
                text = await flush_banner(ctx, pid, "127.0.0.1", port, log_path)
                break
            if not await ctx.transport.pid_alive(pid):
                text = "\n".join(await tail_lines(ctx, log_path, 60))
                break
            await asyncio.sleep(0.2)
    finally:
        await ctx.transport.kill(pid, grace=2.0)
        await ctx.transport.run(remove_argv(ctx, log_path), timeout=30)
    return text


async def write_secret_file(ctx, path: str, key: str) -> None:
    """A key reaches the node as a file created 0600, never in a command line (visible in `ps`) or a log,
    and straight from memory: over SFTP to a remote node, by os.open on the console's own host, never
    through a temporary file on the console's host."""
    await ctx.transport.write_file(path, (key + "\n").encode(), mode=0o600)


def without_key(text: str) -> str:
    """llama-server prints the API key's last characters at start; even those stay out of the job log."""
    return redact_cmdline(text)
