"""The reaper against real processes on this host (local transport): command lines come back redacted."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from llamacpp.reaper import ForeignHolder, find_holders, reap_port
from remote.local import LocalTransport

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-key-4711"
LISTEN = (
    "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); time.sleep(300)"
)


@contextlib.contextmanager
def listener(program: str):
    """A process listening on a free loopback port, started with `--api-key SECRET`; yields (pid, port)."""
    proc = subprocess.Popen([program, "-c", LISTEN, "--api-key", SECRET], stdout=subprocess.PIPE, text=True)
    try:
        yield proc.pid, int(proc.stdout.readline())
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


def ps_args(pid: int) -> str:
    return subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True).stdout


async def test_a_foreign_holders_api_key_reaches_neither_the_holder_nor_the_error():
    with listener(sys.executable) as (pid, port):
        assert SECRET in ps_args(pid)  # The raw command line does carry it.
        async with LocalTransport(command_timeout=60) as local:
            [holder] = await find_holders(local, "linux", port)
            assert holder.pid == pid and not holder.ours
            assert SECRET not in holder.cmdline and "--api-key (hidden)" in holder.cmdline
            with pytest.raises(ForeignHolder) as refused:
                await reap_port(local, "linux", port)
        assert SECRET not in str(refused.value)
        assert psutil.pid_exists(pid)  # Foreign: never touched.


async def test_a_stale_llama_server_with_an_api_key_is_reaped_without_logging_the_key(tmp_path):
    # A hand-started "llama-server": Python under that name, so the reaper counts it as ours.
    program = tmp_path / "llama-server"
    program.symlink_to(Path(sys.executable).resolve())
    lines: list[str] = []

    async def log(text: str) -> None:
        lines.append(text)

    with listener(str(program)) as (pid, port):
        async with LocalTransport(command_timeout=60) as local:
            outcome = await reap_port(local, "linux", port, log=log, grace=2.0)
        assert [holder.pid for holder in outcome.reaped] == [pid]
        assert outcome.reaped[0].kind == "llama-server"
    assert any(f"stale llama-server PID {pid}" in line and "--api-key (hidden)" in line for line in lines)
    assert not any(SECRET in line for line in lines)
