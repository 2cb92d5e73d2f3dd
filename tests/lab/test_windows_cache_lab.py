"""A Windows node's RPC cache through real SSH, against the lab host whose sshd answers like Windows' OpenSSH
server with PowerShell (tests/lab/windows_host.py): the probe and the node page's Read again and Clear read
and clear the cache folder llama.cpp uses on Windows (%LOCALAPPDATA%\\llama.cpp\\rpc, or the node's own
folder), a trim removes the oldest entries down to the limit, and an rpc-server started with the node's own
folder gets it as LLAMA_CACHE. No llama.cpp build is needed: the files are written here as rpc-server
writes them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from jobs.models import Job, JobState
from llamacpp import rpc_cache
from remote.ssh import SSHTarget, SSHTransport
from tests.deploy_fixtures import lab_node, log_text, run
from tests.lab.windows_host import SYSTEM32, USER_HOME, windows_like

pytestmark = [pytest.mark.lab, pytest.mark.timeout(300)]

DEFAULT_DIR = f"{USER_HOME}\\AppData\\Local\\llama.cpp\\rpc"


def _entries(folder: Path, sizes: list[int]) -> list[Path]:
    """Cache entries as rpc-server writes them (named by hash, the first the oldest), beside files that are
    not entries."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    paths = []
    for i, size in enumerate(sizes):
        path = folder / f"{0xABC0 + i:016x}"
        path.write_bytes(os.urandom(size))
        os.utime(path, (now - 1000 + i * 10, now - 1000 + i * 10))
        paths.append(path)
    (folder / "notes.txt").write_text("mine")
    return paths


@pytest.mark.django_db(transaction=True)
def test_a_windows_nodes_cache_is_read_by_the_probe_and_cleared_from_its_page(lab, lab_host, admin_client):
    drive = windows_like(lab, lab_host)
    files = _entries(drive.local(DEFAULT_DIR), [300_000, 200_000, 100_000])
    node = lab_node(lab, lab_host, llama_cache_dir="")

    probe = run(Job.objects.create(kind="probe", node=node))
    assert probe.state == JobState.SUCCEEDED, (probe.result, log_text(probe))
    node.refresh_from_db()
    state = node.rpc_cache_state
    assert (state["dir"], state["entries"], state["bytes"]) == (DEFAULT_DIR, 3, 600_000)
    assert state["free_bytes"] > 0 and sorted(state["names"]) == sorted(p.name for p in files)
    assert f"RPC cache {DEFAULT_DIR}: 3 entries, 0.6 MiB" in log_text(probe)

    page = admin_client.get(node.get_absolute_url()).content.decode()
    panel = page.split('id="rpc-cache"', 1)[1].split('id="node-jobs"', 1)[0]
    assert "3 entries" in panel and "Read again" in panel and "Clear" in panel

    admin_client.post(f"/nodes/{node.name}/rpc-cache/clear/")
    clear = Job.objects.get(node=node, kind="rpc_cache")
    assert clear.params == {"action": "clear"}
    clear = run(clear)
    assert clear.state == JobState.SUCCEEDED, (clear.result, log_text(clear))
    assert clear.result == f"cleared 3 entries (0.6 MiB) from {DEFAULT_DIR}"
    assert not any(p.exists() for p in files) and (drive.local(DEFAULT_DIR) / "notes.txt").exists()
    node.refresh_from_db()
    assert (node.rpc_cache_state["entries"], node.rpc_cache_state["bytes"]) == (0, 0)


@pytest.fixture
def windows(lab, lab_host):
    """(the fake PC's C: drive, a connected SSH transport that detected its shell, a sync runner)."""
    drive = windows_like(lab, lab_host)
    target = SSHTarget(
        shell="",
        host=lab_host.address,
        private_key=lab.client_private_key,
        pinned_host_key=lab_host.host_public_key,
        connect_timeout=5.0,
        command_timeout=60.0,
    )
    loop = asyncio.new_event_loop()
    ssh = SSHTransport(target)
    loop.run_until_complete(ssh.__aenter__())
    yield drive, ssh, loop.run_until_complete
    loop.run_until_complete(ssh.__aexit__(None, None, None))
    loop.close()


def test_a_trim_through_ssh_removes_the_oldest_entries_of_the_nodes_own_folder(windows):
    drive, ssh, run_ = windows
    assert ssh.shell == "windows"
    folder = "C:\\llama cache\\it's $(here)"
    files = _entries(drive.local(folder + "\\rpc"), [300_000, 200_000, 100_000])
    result = run_(ssh.run(rpc_cache.script_argv("trim", folder, 350_000, windows=True), timeout=60))
    assert result.ok, result.stderr
    found = rpc_cache.parse(result.stdout)
    assert found["dir"] == folder + "\\rpc"
    assert found["removed"] == [(files[0].name, 300_000)]
    assert (found["entries"], found["bytes"]) == (2, 300_000) and found["free_bytes"] > 0
    assert [p.exists() for p in files] == [False, True, True]


def test_an_rpc_server_started_with_the_nodes_own_folder_gets_it_as_llama_cache(windows):
    """Windows has no `env` program: the detached start sets $env:LLAMA_CACHE in the PowerShell that runs
    Start-Process, whose environment the program inherits."""
    drive, ssh, run_ = windows
    shows = drive.root / "show-env.py"
    shows.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps([os.environ.get('LLAMA_CACHE'), sys.argv[1:]]), flush=True)\n"
    )
    shows.chmod(0o755)
    drive.install(f"{SYSTEM32}\\show-env.exe", shows)
    program = f"{SYSTEM32}\\show-env.exe"
    argv = rpc_cache.server_argv(program, ["-p", "50052"], "D:\\llama's cache", windows=True)
    log = f"{USER_HOME}\\show-env.log"
    pid = run_(ssh.start_daemon(argv, log_path=log))
    assert pid > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not drive.local(log).read_text().strip():
        time.sleep(0.1)
    assert json.loads(drive.local(log).read_text()) == ["D:\\llama's cache", ["-p", "50052", "-c"]]
