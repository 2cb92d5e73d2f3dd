"""The local transport: real subprocesses on this host, the same behaviour as the SSH transport."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from nodes.transports import transport_for
from remote.base import CommandFailed, CommandTimeout, TransportError, daemon_script
from remote.local import LocalTransport
from tests.factories import NodeFactory

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def local():
    async with LocalTransport(command_timeout=60) as transport:
        yield transport


async def test_a_command_streams_both_streams_and_its_exit_status(local):
    result = await local.run(["sh", "-c", "echo one; echo two >&2; echo three; exit 4"])
    assert [line.text for line in result.lines if line.stream == "out"] == ["one", "three"]
    assert [line.text for line in result.lines if line.stream == "err"] == ["two"]
    assert result.exit_status == 4


async def test_lines_arrive_while_the_command_is_still_running(local, tmp_path):
    gate = tmp_path / "gate"
    script = f'echo ready; while [ ! -e "{gate}" ]; do sleep 0.05; done; echo done'
    seen = []
    command = local.command(["sh", "-c", script], timeout=60)
    async for line in command.lines():
        seen.append(line.text)
        if line.text == "ready":
            gate.touch()
    assert seen == ["ready", "done"]
    assert command.result.exit_status == 0


async def test_two_hundred_thousand_lines_all_arrive_in_order(local):
    texts = [line.text async for line in local.command(["seq", "1", "200000"]).lines()]
    assert texts == [str(n) for n in range(1, 200_001)]


async def test_nul_bytes_are_dropped_and_invalid_utf8_is_replaced(local):
    result = await local.run(["printf", r"a\000b\377c\nlast line without newline"])
    assert [line.text for line in result.lines] == ["ab\ufffdc", "last line without newline"]


async def test_environment_additions_reach_the_command(local):
    command = local.command(["sh", "-c", 'echo "$RAMDECK_X"'], env={"RAMDECK_X": "42"})
    lines = [line.text async for line in command.lines()]
    assert lines == ["42"]


async def test_a_missing_program_is_a_transport_error(local):
    with pytest.raises(TransportError, match="'no-such-tool-xyz' was not found on this host"):
        await local.run(["no-such-tool-xyz"])


async def test_check_turns_a_non_zero_exit_into_command_failed(local):
    with pytest.raises(CommandFailed, match="exit status 3: nope"):
        await local.run(["sh", "-c", "echo nope >&2; exit 3"], check=True)


async def test_an_overrun_ends_the_command_and_its_children(local, tmp_path):
    command = local.command(["sh", "-c", "sleep 300 & sleep 300; wait"], timeout=1)
    with pytest.raises(CommandTimeout, match="longer than 1 s"):
        [line async for line in command.lines()]
    assert command.pid and not await local.pid_alive(command.pid)


async def test_a_stream_closed_early_ends_the_command(local):
    command = local.command(["sh", "-c", "echo started; exec sleep 300"])
    async with contextlib.aclosing(command.lines()) as lines:
        async for line in lines:
            assert line.text == "started"
            break
    assert not await local.pid_alive(command.pid)
    with pytest.raises(RuntimeError, match="has not ended"):
        command.result  # noqa: B018 - reading it is the test


async def test_starting_a_daemon_during_a_command_leaves_its_handle_alone(local, tmp_path):
    gate = tmp_path / "gate"
    script = f'echo ready; while [ ! -e "{gate}" ]; do sleep 0.05; done; exit 5'
    command = local.command(["sh", "-c", script])
    async for line in command.lines():
        assert line.text == "ready"
        pid = command.pid
        daemon = await local.start_daemon(["sleep", "600"], log_path=str(tmp_path / "d.log"))
        assert command.pid == pid and daemon != pid
        assert await local.kill(daemon, grace=1.0)
        gate.touch()
    assert command.result.exit_status == 5 and command.pid == pid


async def test_a_signal_is_reported_as_such(local):
    result = await local.run(["sh", "-c", "kill -TERM $$"])
    assert result.exit_status is None
    assert result.signal == "TERM"


async def test_a_daemon_survives_and_is_killed_by_pid(local, tmp_path):
    log = tmp_path / "daemon.log"
    pid = await local.start_daemon(
        ["sh", "-c", "echo up; exec sleep 600"], log_path=str(log), cwd=str(tmp_path)
    )
    try:
        assert await local.pid_alive(pid)
        # The log is line-buffered: the first line is there without the daemon exiting.
        for _ in range(100):
            if log.exists() and log.read_bytes():
                break
            await asyncio.sleep(0.05)
        assert await local.read_head(str(log), 100) == b"up\n"
    finally:
        assert await local.kill(pid, grace=2.0)
    assert not await local.pid_alive(pid)


def _end(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=10)


def _cmdline_settles(pid: int, program: str) -> list[str]:
    """The command line of pid once it runs `program` (or after 10 s, whatever it runs then).

    Right after the fork the PID still shows the launching shell, then setsid, nohup and stdbuf in turn,
    each exec'ing in place.
    """
    for _ in range(200):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        if args and args[0] == program:
            break
        time.sleep(0.05)
    return args


def _hup_ignored(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask & (1 << (signal.SIGHUP - 1)))


@pytest.mark.parametrize("shell", ["sh", "bash"])
@pytest.mark.parametrize("tools", ["setsid and stdbuf", "neither (as on macOS)"])
def test_the_daemon_script_starts_the_program_itself_with_or_without_setsid_and_stdbuf(
    shell, tools, tmp_path
):
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    path = os.environ["PATH"]
    if tools.startswith("neither"):
        # A PATH that has nohup but neither setsid nor stdbuf, like a stock Mac.
        bindir = tmp_path / "bin"
        bindir.mkdir()
        (bindir / "nohup").symlink_to(shutil.which("nohup"))
        path = str(bindir)
    marker = f"ramdeck-daemon-under-test-{uuid.uuid4().hex}"
    argv = [sys.executable, "-c", "import time, sys; time.sleep(300)", marker]
    script = daemon_script(argv, log_path=str(workdir / "d.log"), cwd=str(workdir))
    try:
        launcher = subprocess.run(
            [shutil.which(shell), "-c", script],
            env={"PATH": path},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert launcher.returncode == 0, launcher.stderr
        pid = int(launcher.stdout.split()[-1])
        # `$!` is the program's own PID, not a subshell's or a wrapper's: once setsid, nohup and stdbuf
        # have exec'd in place, that PID runs exactly argv.
        assert _cmdline_settles(pid, argv[0]) == argv
        assert Path(f"/proc/{pid}/cwd").resolve() == workdir.resolve()
        assert _hup_ignored(pid)
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        if tools.startswith("neither"):
            assert os.getsid(pid) != pid and b"libstdbuf" not in environ
        else:
            assert os.getsid(pid) == pid and b"libstdbuf" in environ
    finally:
        # Everything this test started carries its unique marker (a broken launcher may leave a shell).
        for process in psutil.process_iter(["cmdline"]):
            if marker in (process.info["cmdline"] or []) or marker in " ".join(process.info["cmdline"] or []):
                _end(process.pid)


def test_the_daemon_script_starts_nothing_when_its_folder_is_missing(tmp_path):
    script = daemon_script(["sleep", "300"], log_path=str(tmp_path / "d.log"), cwd=str(tmp_path / "gone"))
    launcher = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert launcher.returncode == 1 and launcher.stdout == ""


async def test_upload_copies_and_read_head_reads_the_start(local, tmp_path):
    source = tmp_path / "a.bin"
    source.write_bytes(b"GGUF" + bytes(100))
    await local.upload(str(source), str(tmp_path / "b.bin"))
    assert await local.read_head(str(tmp_path / "b.bin"), 4) == b"GGUF"
    with pytest.raises(TransportError, match="No such file"):
        await local.read_head(str(tmp_path / "missing"), 4)


@pytest.mark.django_db
def test_transport_for_picks_the_local_transport_for_a_local_node():
    node = NodeFactory(transport="local", address="127.0.0.1")
    assert isinstance(transport_for(node), LocalTransport)


@pytest.mark.django_db
def test_transport_for_refuses_an_ssh_node_without_credential():
    node = NodeFactory(credential=None)
    with pytest.raises(TransportError, match="has no credential"):
        transport_for(node)


@pytest.mark.security
async def test_a_secret_is_written_from_memory_with_mode_0600_whatever_the_umask(
    local, tmp_path, monkeypatch
):
    import tempfile

    console_tmp = tmp_path / "console-tmp"
    console_tmp.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(console_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(console_tmp))
    path = tmp_path / "secret.key"
    path.write_text("old\n")
    path.chmod(0o644)
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    link = tmp_path / "planted.key"
    link.symlink_to(target)
    previous = os.umask(0)
    try:
        await local.write_file(str(path), b"s3cret\n")
        await local.write_file(str(link), b"s3cret\n")
    finally:
        os.umask(previous)
    assert path.read_bytes() == b"s3cret\n" and oct(path.stat().st_mode & 0o777) == "0o600"
    assert not link.is_symlink() and target.read_text() == "untouched\n"
    assert list(console_tmp.iterdir()) == []
    with pytest.raises(TransportError, match="Writing .*missing/x.key failed"):
        await local.write_file(str(tmp_path / "missing" / "x.key"), b"k")


@pytest.mark.security
async def test_a_process_that_prints_without_end_is_cut_and_memory_stays_bounded():
    import tracemalloc

    local = LocalTransport(output_limit=2**20)
    flood = "head -c 16777216 /dev/zero | tr '\\0' x; echo; yes 'a line of output' | head -c 8388608"
    tracemalloc.start()
    try:
        result = await local.run(["sh", "-c", flood], timeout=120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.ok
    assert result.lines[0].text.endswith(f" … [{16 * 2**20 - 65536} more bytes of this line cut]")
    assert sum(len(line.text) + 1 for line in result.lines[:-1]) <= 2**20
    assert result.lines[-1].text.startswith("[output truncated after ")
    assert peak < 24 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    print(f"\nOUTPUT-BOUND local 24 MiB printed, {len(result.lines)} lines kept, peak {peak / 2**20:.1f} MiB")
