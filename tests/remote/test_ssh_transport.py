"""The SSH transport against real OpenSSH sshd processes in network-namespace lab hosts."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from asgiref.sync import sync_to_async

from nodes.models import CredentialKind, Reachability
from nodes.transports import transport_for
from remote.base import (
    CommandFailed,
    CommandTimeout,
    HostKeyChanged,
    HostKeyUnknown,
    TransportError,
)
from remote.ssh import SSHTarget, SSHTransport, fingerprint_of
from tests.factories import CredentialFactory, NodeFactory
from tests.lab.netlab import PASSWORD_USER, PASSWORD_USER_PASSWORD
from tests.paths import ROOT

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]


def target_for(lab, host, **overrides) -> SSHTarget:
    """A pinned, key-authenticated target for a lab host."""
    options = {
        "host": host.address,
        "private_key": lab.client_private_key,
        "connect_timeout": 3.0,
        "keepalive_interval": 1.0,
        "keepalive_count_max": 3,
        "command_timeout": 60.0,
    }
    options.update(overrides)
    if "pinned_host_key" not in options:
        options["pinned_host_key"] = host.host_public_key
    return SSHTarget(**options)


def accepted_logins(host) -> int:
    return (host.workdir / "sshd.log").read_text().count("Accepted ")


async def test_a_command_streams_stdout_and_stderr_lines_and_its_exit_status(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        result = await ssh.run(["sh", "-c", "echo one; echo two >&2; echo three; exit 3"])
    assert [(line.stream, line.text) for line in result.lines if line.stream == "out"] == [
        ("out", "one"),
        ("out", "three"),
    ]
    assert [line.text for line in result.lines if line.stream == "err"] == ["two"]
    assert result.exit_status == 3
    assert not result.ok


async def test_lines_arrive_while_the_command_is_still_running(lab, lab_host, tmp_path):
    # The command waits for a file that the test creates only after it has received the first line,
    # so the test can only finish if lines are delivered as they come, not at the end.
    gate = tmp_path / "gate"
    script = f'echo ready; while [ ! -e "{gate}" ]; do sleep 0.05; done; echo done'
    seen = []
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        command = ssh.command(["sh", "-c", script], timeout=60)
        async for line in command.lines():
            seen.append(line.text)
            if line.text == "ready":
                gate.touch()
        assert command.result.exit_status == 0
    assert seen == ["ready", "done"]


async def test_two_hundred_thousand_lines_all_arrive_in_order(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        command = ssh.command(["seq", "1", "200000"])
        texts = [line.text async for line in command.lines()]
        assert command.result.exit_status == 0
    assert len(texts) == 200_000
    assert texts == [str(n) for n in range(1, 200_001)]


async def test_nul_bytes_are_dropped_and_invalid_utf8_is_replaced(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        result = await ssh.run(["printf", r"a\000b\377c\nplain\n"])
    assert [line.text for line in result.lines] == ["ab\ufffdc", "plain"]


async def test_a_missing_command_is_a_transport_error_naming_it(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        with pytest.raises(TransportError, match="'no-such-tool-xyz' was not found on 10.77"):
            await ssh.run(["no-such-tool-xyz", "--version"])


async def test_a_failing_command_with_check_raises_command_failed_with_its_output(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        with pytest.raises(CommandFailed, match="exit status 2: broken") as caught:
            await ssh.run(["sh", "-c", "echo broken >&2; exit 2"], check=True)
    assert caught.value.result.exit_status == 2


async def test_a_command_that_overruns_its_timeout_is_ended_on_the_node(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        command = ssh.command(["sleep", "300"], timeout=1)
        with pytest.raises(CommandTimeout, match="ran longer than 1 s"):
            [line async for line in command.lines()]
        assert command.pid is not None
        assert not await ssh.pid_alive(command.pid)


async def test_a_stream_closed_early_ends_the_command_on_the_node(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        command = ssh.command(["sh", "-c", "echo started; exec sleep 300"])
        async with contextlib.aclosing(command.lines()) as lines:
            async for line in lines:
                assert line.text == "started"
                break
        pid = command.pid
        assert pid is not None
        assert not await ssh.pid_alive(pid)


async def test_helper_commands_during_a_command_leave_its_handle_alone(lab, lab_host, tmp_path):
    gate = tmp_path / "gate"
    script = f'echo ready; while [ ! -e "{gate}" ]; do sleep 0.05; done; exit 5'
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        command = ssh.command(["sh", "-c", script])
        async for line in command.lines():
            assert line.text == "ready"
            pid = command.pid
            assert pid is not None and await ssh.pid_alive(pid)
            assert command.pid == pid and command.running  # The helper command did not disturb it.
            gate.touch()
        assert command.result.exit_status == 5
        assert command.pid == pid and not command.running


async def test_killing_the_streaming_command_by_pid_ends_it_with_term(lab, lab_host):
    # What the runner does when an operator cancels a job.
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        command = ssh.command(["sh", "-c", "echo ready; exec sleep 300"])
        async for line in command.lines():
            assert line.text == "ready"
            assert await ssh.kill(command.pid, grace=2.0)
        assert command.result.signal == "TERM"
        assert command.result.exit_status is None


async def test_the_tcp_handshake_gives_the_round_trip_time(lab, lab_host):
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        assert ssh.rtt_ms is not None and ssh.rtt_ms > 0


async def test_a_key_the_node_does_not_authorise_is_refused_with_a_clear_message(lab, lab_host):
    target = target_for(lab, lab_host, private_key=lab.other_private_key())
    with pytest.raises(TransportError, match="refused the login as 'root' with the private key"):
        async with SSHTransport(target):
            pass


async def test_password_login_works_and_a_wrong_password_is_refused(lab):
    host = lab.add_host(password_auth=True)
    good = target_for(lab, host, private_key=None, username=PASSWORD_USER, password=PASSWORD_USER_PASSWORD)
    async with SSHTransport(good) as ssh:
        assert (await ssh.run(["id", "-un"])).stdout == PASSWORD_USER
    bad = target_for(lab, host, private_key=None, username=PASSWORD_USER, password="not the password")
    with pytest.raises(TransportError, match="refused the login .* with the password"):
        async with SSHTransport(bad):
            pass


async def test_first_contact_reports_the_offered_key_and_runs_nothing(lab, lab_host):
    target = target_for(lab, lab_host, pinned_host_key="")
    with pytest.raises(HostKeyUnknown) as caught:
        async with SSHTransport(target):
            pytest.fail("connected without an approved host key")
    assert caught.value.offered_key == lab_host.host_public_key
    assert caught.value.fingerprint == fingerprint_of(lab_host.host_public_key)
    assert "approve" in str(caught.value)
    assert accepted_logins(lab_host) == 0  # Refused before authentication: nothing ran.


async def test_a_changed_host_key_blocks_the_connection(lab, lab_host):
    approved = lab_host.host_public_key
    lab.start_sshd(lab_host, new_host_key=True)
    with pytest.raises(HostKeyChanged, match="CHANGED") as caught:
        async with SSHTransport(target_for(lab, lab_host, pinned_host_key=approved)):
            pytest.fail("connected to a host whose key changed")
    assert caught.value.offered_key == lab_host.host_public_key != approved
    assert accepted_logins(lab_host) == 0


async def test_a_host_without_sshd_is_refused_with_a_clear_message(lab):
    host = lab.add_host(sshd=False)
    with pytest.raises(TransportError, match="refused the connection: is sshd running"):
        async with SSHTransport(target_for(lab, host, pinned_host_key="")):
            pass


async def test_a_host_that_never_answers_fails_after_the_connect_timeout(lab, lab_host):
    lab.link_down(lab_host)  # Packets vanish: no refusal, no answer at all.
    with pytest.raises(TransportError, match="did not answer within 2 s"):
        async with SSHTransport(target_for(lab, lab_host, connect_timeout=2.0)):
            pass


@pytest.mark.timeout(60)
async def test_a_node_that_goes_away_mid_command_ends_in_a_transport_error(lab, lab_host):
    # Keepalive every second, three misses: the loss is noticed within a few seconds, not hours.
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        with pytest.raises(TransportError, match="connection to .* was lost"):
            async for line in ssh.command(["sh", "-c", "echo started; sleep 300"], timeout=3600).lines():
                if line.text == "started":
                    lab.link_down(lab_host)


async def test_a_daemon_outlives_the_session_and_is_killed_by_pid(lab, lab_host):
    log = lab_host.workdir / "daemon.log"
    script = 'echo "daemon up"; exec sleep 600'
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        pid = await ssh.start_daemon(["sh", "-c", script], log_path=str(log), cwd=str(lab_host.workdir))
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        assert await ssh.pid_alive(pid)
        assert await ssh.read_head(str(log), 100) == b"daemon up\n"
        assert await ssh.kill(pid, grace=2.0)
        assert not await ssh.pid_alive(pid)


async def test_upload_then_read_head_returns_the_first_bytes(lab, lab_host, tmp_path):
    source = tmp_path / "payload.bin"
    source.write_bytes(bytes(range(256)) * 4)
    remote = lab_host.workdir / "uploaded.bin"
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        await ssh.upload(str(source), str(remote))
        assert await ssh.read_head(str(remote), 16) == bytes(range(16))
        with pytest.raises(TransportError, match="Reading .*missing.bin failed"):
            await ssh.read_head(str(lab_host.workdir / "missing.bin"), 16)
    assert remote.read_bytes() == source.read_bytes()


# -- through Node rows: pending keys are stored, approval lets jobs run -------------------------------


def _node_for(lab, host, **fields):
    credential = CredentialFactory(kind=CredentialKind.PRIVATE_KEY, secret=lab.client_private_key)
    return NodeFactory(address=host.address, ssh_user="root", credential=credential, **fields)


@pytest.mark.django_db(transaction=True)
async def test_first_contact_stores_the_offered_key_as_pending_on_the_node(lab, lab_host, settings):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0
    node = await sync_to_async(_node_for)(lab, lab_host)
    transport = await sync_to_async(transport_for)(node)
    with pytest.raises(HostKeyUnknown):
        async with transport:
            pass
    await node.arefresh_from_db()
    assert node.host_key == ""
    assert node.pending_host_key == lab_host.host_public_key
    assert node.pending_host_key_fingerprint == fingerprint_of(lab_host.host_public_key)
    assert node.reachability == Reachability.HOST_KEY_PENDING
    assert accepted_logins(lab_host) == 0


@pytest.mark.django_db(transaction=True)
async def test_an_approved_key_lets_commands_run_and_a_changed_one_is_stored_for_review(
    lab, lab_host, settings
):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0
    approved = lab_host.host_public_key
    node = await sync_to_async(_node_for)(lab, lab_host, host_key=approved)
    async with await sync_to_async(transport_for)(node) as ssh:
        assert (await ssh.run(["echo", "hello from the lab"])).stdout == "hello from the lab"

    lab.start_sshd(lab_host, new_host_key=True)
    with pytest.raises(HostKeyChanged):
        async with await sync_to_async(transport_for)(node):
            pass
    await node.arefresh_from_db()
    assert node.host_key == approved  # The approved key stays until an admin approves the new one.
    assert node.pending_host_key == lab_host.host_public_key
    assert node.reachability == Reachability.HOST_KEY_CHANGED
    assert "CHANGED" in node.last_error


@pytest.mark.django_db(transaction=True)
async def test_an_unreachable_node_is_marked_with_the_reason(lab, settings):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 2.0
    host = lab.add_host(sshd=False)
    node = await sync_to_async(_node_for)(lab, host, host_key=" ".join(lab.client_public_key.split()[:2]))
    with pytest.raises(TransportError):
        async with await sync_to_async(transport_for)(node):
            pass
    await node.arefresh_from_db()
    assert node.reachability == Reachability.UNREACHABLE
    assert "refused the connection" in node.last_error


def test_no_code_path_turns_host_key_checking_off():
    """asyncssh disables host-key checking with known_hosts=None; the console must never pass it."""
    product = [
        p for p in ROOT.rglob("*.py") if not {".venv", "tests", "var"} & set(p.relative_to(ROOT).parts)
    ]
    assert any("known_hosts" in p.read_text() for p in product)  # the scan reads the transport's module
    assert not any("known_hosts=None" in p.read_text() for p in product)
    assert asyncio.iscoroutinefunction(SSHTransport.connect)


@pytest.mark.security
async def test_a_secret_is_written_from_memory_into_a_file_that_is_0600_from_its_creation(
    lab, lab_host, tmp_path, monkeypatch
):
    """write_file creates the file over SFTP with mode 0600 before a byte of the secret is in it (checked at
    the first write), replaces an older, wider file, follows no planted link, and uses no local file."""
    import tempfile

    import asyncssh

    console_tmp = tmp_path / "console-tmp"
    console_tmp.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(console_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(console_tmp))
    seen, writing = [], []
    original = asyncssh.SFTPClientFile.write

    async def watching(self, data, offset=None):
        info = writing[-1].lstat()
        seen.append((oct(info.st_mode & 0o777), info.st_size, sorted(p.name for p in console_tmp.iterdir())))
        return await original(self, data, offset)

    monkeypatch.setattr(asyncssh.SFTPClientFile, "write", watching)
    remote = lab_host.workdir / "secret.key"
    remote.write_text("old\n")
    remote.chmod(0o644)
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    link = lab_host.workdir / "planted.key"
    link.symlink_to(target)
    async with SSHTransport(target_for(lab, lab_host)) as ssh:
        for path in (remote, link):
            writing.append(path)
            await ssh.write_file(str(path), b"s3cret\n")
    assert seen == [("0o600", 0, []), ("0o600", 0, [])]
    assert remote.read_bytes() == b"s3cret\n" and oct(remote.stat().st_mode & 0o777) == "0o600"
    assert not link.is_symlink() and oct(link.stat().st_mode & 0o777) == "0o600"
    assert target.read_text() == "untouched\n"
    assert list(console_tmp.iterdir()) == []


@pytest.mark.security
async def test_a_node_that_prints_without_end_is_cut_and_memory_stays_bounded(lab, lab_host):
    """24 MiB of output, 16 of them one line without a newline: the console keeps the first 1 MiB (the
    budget set here), each line at most 64 KiB, and says what it cut."""
    import tracemalloc

    target = target_for(lab, lab_host)
    target.output_limit = 2**20
    flood = "head -c 16777216 /dev/zero | tr '\\0' x; echo; yes 'a line of output' | head -c 8388608"
    tracemalloc.start()
    try:
        async with SSHTransport(target) as ssh:
            result = await ssh.run(["sh", "-c", flood], timeout=120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.ok
    first = result.lines[0].text
    assert first.startswith("x" * 1000) and first.endswith(
        f" … [{16 * 2**20 - 65536} more bytes of this line cut]"
    )
    assert sum(len(line.text) + 1 for line in result.lines[:-1]) <= 2**20
    note = result.lines[-1]
    assert note.stream == "err" and note.text.startswith("[output truncated after ")
    assert "lines were not kept" in note.text
    assert peak < 24 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    print(f"\nOUTPUT-BOUND ssh 24 MiB printed, {len(result.lines)} lines kept, peak {peak / 2**20:.1f} MiB")
