"""What job bodies do on their node through `ctx.transport`, whatever the job: the run folder, a log's
tail, waiting for a listener, and writing a secret file the node alone can read."""

from __future__ import annotations

import asyncio
import posixpath

from jobs.context import JobFailed
from llamacpp.reaper import find_holders
from remote.listeners import redact_cmdline


async def run_dir(ctx) -> str:
    """~/.ramdeck/run on the node: logs and key files of the processes the console starts."""
    home = (await ctx.transport.run(["printenv", "HOME"], timeout=30)).stdout.strip() or "/tmp"
    path = posixpath.join(home, ".ramdeck", "run")
    await ctx.transport.run(["mkdir", "-p", path], timeout=30)
    return path


async def tail_lines(ctx, path: str, count: int = 20) -> list[str]:
    result = await ctx.transport.run(["tail", "-n", str(count), path], timeout=30)
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


async def write_secret_file(ctx, path: str, key: str) -> None:
    """A key reaches the node as a file created 0600, never in a command line (visible in `ps`) or a log,
    and straight from memory: over SFTP to a remote node, by os.open on the console's own host, never
    through a temporary file on the console's host."""
    await ctx.transport.write_file(path, (key + "\n").encode(), mode=0o600)


def without_key(text: str) -> str:
    """llama-server prints the API key's last characters at start; even those stay out of the job log."""
    return redact_cmdline(text)
