"""The Windows command path through real SSH, against a lab host whose sshd answers like Windows' OpenSSH
server with PowerShell as its shell (tests/lab/windows_host.py, tests/lab/fake_powershell.py): the transport
tells its shell apart at the first connection, hostile values reach a Windows program exactly (or are
refused), a POSIX command fails there as it would on Windows, the probe reads the PC's CIM classes, and the
RPC port's holder is found with Get-NetTCPConnection and ended with Stop-Process -Id."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builds.forms import BuildForm
from builds.models import Build, BuildSource
from jobs.models import Job, JobState
from llamacpp import rpc_guard
from llamacpp.reaper import ForeignHolder, find_holders, reap_port
from nodes.models import DeviceKind
from nodes.transports import shell_for
from remote.base import TransportError
from remote.powershell import NotForWindows, pid_file, powershell_argv, start_detached_script
from remote.ssh import SSHTarget, SSHTransport
from tests.deploy_fixtures import (
    lab_node,
    listeners_in,
    log_text,
    route_between,
    rpc_server_binary,
    run,
    start_in,
    step_deployment,
)
from tests.lab.windows_host import USER_HOME, windows_like
from tests.llamacpp_build import require_llamacpp
from tests.paths import DATA
from tests.remote.test_powershell import HOSTILE

pytestmark = [pytest.mark.lab, pytest.mark.timeout(300)]

THROUGH_SSH = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


def _target(lab, host, **options) -> SSHTarget:
    """A target whose platform is not known yet: the transport tells its shell apart when it connects."""
    return SSHTarget(
        shell="",
        host=host.address,
        private_key=lab.client_private_key,
        pinned_host_key=host.host_public_key,
        connect_timeout=5.0,
        command_timeout=60.0,
        **options,
    )


@pytest.fixture
def windows(lab, lab_host):
    """(the fake PC's C: drive, a connected SSH transport that detected its shell, a sync runner)."""
    drive = windows_like(lab, lab_host)
    loop = asyncio.new_event_loop()
    ssh = SSHTransport(_target(lab, lab_host))
    loop.run_until_complete(ssh.__aenter__())
    yield drive, ssh, loop.run_until_complete
    loop.run_until_complete(ssh.__aexit__(None, None, None))
    loop.close()


def test_the_first_connection_tells_a_powershell_node_from_a_posix_one(lab, lab_hosts, windows):
    _, ssh, run = windows
    assert (ssh.shell, ssh.windows_shell) == ("windows", "powershell")
    (posix_host,) = lab_hosts(1)

    async def detect() -> tuple[str, str]:
        async with SSHTransport(_target(lab, posix_host)) as plain:
            return plain.shell, plain.windows_shell

    assert asyncio.run(detect()) == ("posix", "")


def test_a_posix_command_fails_on_the_windows_node_as_powershell_says(windows):
    _, ssh, run = windows
    for argv in (["printenv", "HOME"], ["sh", "-c", "echo hi"], ["ps", "-o", "args=", "-p", "1"]):
        result = run(ssh.run(argv, timeout=30))
        assert result.exit_status == 1
        errors = "\n".join(line.text for line in result.lines if line.stream == "err")
        assert f"The term '{argv[0]}' is not recognized as the name of a cmdlet" in errors, errors


def test_the_transport_learns_the_pid_of_a_windows_command(windows):
    _, ssh, run = windows

    async def pid_of() -> int | None:
        command = ssh.command(["echo-argv", "x"], timeout=30)
        async for _ in command.lines():
            pass
        return command.pid

    assert isinstance(run(pid_of()), int)


@given(argv=st.lists(HOSTILE, min_size=1, max_size=6))
@THROUGH_SSH
def test_any_argument_vector_reaches_a_windows_program_exactly_or_is_refused(windows, argv):
    _, ssh, run = windows
    if any("\x00" in arg for arg in argv):
        with pytest.raises(ValueError, match="NUL"):
            run(ssh.run(["echo-argv", *argv], timeout=30))
        return
    try:
        result = run(ssh.run(["echo-argv", *argv], timeout=30, check=True))
    except NotForWindows as exc:
        assert "not run" in str(exc) or "longer than the 8191" in str(exc)
        return
    assert json.loads(result.stdout) == argv


@given(args=st.lists(HOSTILE.filter(lambda a: "\x00" not in a), min_size=0, max_size=4))
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_a_detached_windows_program_gets_its_argument_vector_exactly(windows, args):
    drive, ssh, run = windows
    log = f"{USER_HOME}\\echo-{secrets.token_hex(4)}.log"
    try:
        pid = run(ssh.start_daemon(["C:\\Windows\\System32\\echo-argv.exe", *args], log_path=log))
    except NotForWindows as exc:
        assert "longer than the 8191" in str(exc)
        return
    for _ in range(100):
        if not run(ssh.pid_alive(pid)):
            break
        run(asyncio.sleep(0.05))
    assert json.loads(drive.local(log).read_text()) == args
    assert drive.local(log + ".err").exists()


def test_a_refused_value_names_the_argument_and_runs_nothing(windows):
    _, ssh, run = windows
    with pytest.raises(NotForWindows, match=r"Argument 2 of 'echo-argv' contains a double quote"):
        run(ssh.run(["echo-argv", "ok", 'say "hi"'], timeout=30))


def test_an_unknown_program_is_not_found_on_the_windows_node(windows):
    _, ssh, run = windows
    result = run(ssh.run(["C:\\llama\\rpc-server.exe", "--version"], timeout=30))
    assert result.exit_status == 1
    assert "is not recognized" in "\n".join(line.text for line in result.lines)


def test_a_lost_connection_still_says_so(windows, lab, lab_host):
    """The shell detection runs after authentication; an sshd that is gone is a TransportError as before."""
    lab.stop_sshd(lab_host)

    async def connect() -> None:
        async with SSHTransport(_target(lab, lab_host)):
            pass

    with pytest.raises(TransportError):
        asyncio.run(connect())


# --- the probe, through the console's own job --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_probe_reads_a_windows_pcs_hardware_through_ssh(lab, lab_host):
    windows_like(lab, lab_host)
    node = lab_node(lab, lab_host)
    assert shell_for(node) == ""  # never probed: the first connection tells the shells apart

    probe = run(Job.objects.create(kind="probe", node=node))

    assert probe.state == JobState.SUCCEEDED, (probe.result, log_text(probe))
    node.refresh_from_db()
    assert node.platform == "windows" and shell_for(node) == "windows"
    assert (node.facts["os_name"], node.facts["hostname"]) == ("Microsoft Windows 11 Pro", "GAMING-PC")
    assert node.facts["cpu_cores"] == 16 and node.facts["arch"] == "x86_64"
    [cpu] = node.devices.all()
    assert (cpu.name, cpu.kind) == ("CPU", DeviceKind.CPU)
    assert cpu.description == "AMD Ryzen 7 5800X 8-Core Processor"
    assert (cpu.total_bytes, cpu.free_bytes) == (33473476 * 1024, 21036544 * 1024)
    # Its second probe knows it is Windows from the first; the RPC port's listener is asked of
    # Get-NetTCPConnection, which sees nobody on it.
    again = run(Job.objects.create(kind="probe", node=node))
    assert again.state == JobState.SUCCEEDED, (again.result, log_text(again))
    node.refresh_from_db()
    assert node.facts["rpc_port_in_use"] is False


@pytest.mark.django_db(transaction=True)
def test_the_probe_finds_nvidia_gpus_on_windows_through_nvidia_smi(lab, lab_host):
    windows_like(lab, lab_host, nvidia_smi=(DATA / "probe" / "nvidia_smi_one_gpu.csv").read_text().strip())
    node = lab_node(lab, lab_host)
    probe = run(Job.objects.create(kind="probe", node=node))
    assert probe.state == JobState.SUCCEEDED, (probe.result, log_text(probe))
    gpu = node.devices.get(name="CUDA0")
    assert (gpu.kind, gpu.description, gpu.total_bytes) == (
        DeviceKind.CUDA,
        "NVIDIA GeForce RTX 3090",
        24576 * 1024**2,
    )


@pytest.mark.django_db(transaction=True)
def test_a_node_set_to_windows_that_answers_with_sh_is_told_what_to_change(lab, lab_host):
    node = lab_node(lab, lab_host, platform_hint="windows")
    probe = run(Job.objects.create(kind="probe", node=node))
    assert probe.state == JobState.FAILED
    assert "answered with a POSIX shell" in probe.result and "WSL2" in probe.result


# --- reaping and starting rpc-server.exe --------------------------------------------------------------------


@pytest.mark.llamacpp
def test_rpc_server_exe_starts_detached_and_its_port_is_reaped_by_pid(lab, lab_host):
    """The real ggml-rpc-server stands for C:\\llama\\rpc-server.exe: Start-Process starts it with its
    output in a log file and its PID printed; Get-NetTCPConnection finds it on its port, Win32_Process's
    command line says it is ours, and Stop-Process -Id ends it; a foreign listener is named, not touched."""
    drive = windows_like(lab, lab_host)
    drive.install("C:\\llama\\rpc-server.exe", rpc_server_binary())
    port = 41000 + secrets.randbelow(9000)
    log = f"{USER_HOME}\\rpc-{port}.log"

    async def scenario() -> tuple:
        async with SSHTransport(_target(lab, lab_host)) as ssh:
            pid = await ssh.start_daemon(
                ["C:\\llama\\rpc-server.exe", "-H", "127.0.0.1", "-p", str(port)], log_path=log
            )
            holders: list = []
            for _ in range(100):
                holders = await find_holders(ssh, "windows", port)
                if holders:
                    break
                await asyncio.sleep(0.1)
            alive = await ssh.pid_alive(pid)
            reaped = await reap_port(ssh, "windows", port, grace=2.0)
            return pid, holders, alive, reaped, await ssh.pid_alive(pid)

    pid, holders, alive, reaped, alive_after = asyncio.run(scenario())
    assert alive and not alive_after
    [holder] = holders
    assert (holder.pid, holder.kind) == (pid, "rpc-server")
    assert holder.cmdline == f'"C:\\llama\\rpc-server.exe" -H 127.0.0.1 -p {port}'
    assert [h.pid for h in reaped.reaped] == [pid] and f"reaped rpc-server PID {pid}" in reaped.summary
    assert drive.local(log).exists() and drive.local(log + ".err").exists()
    assert not listeners_in(lab_host, port)


def test_a_foreign_listener_on_a_windows_nodes_port_is_named_and_left_alone(lab, lab_host, tmp_path):
    windows_like(lab, lab_host)
    port = 41000 + secrets.randbelow(9000)
    foreign = start_in(
        lab_host, [sys.executable, "-m", "http.server", "-b", "127.0.0.1", str(port)], tmp_path / "h.log"
    )
    for _ in range(100):
        if listeners_in(lab_host, port):
            break
        time.sleep(0.1)

    async def reap() -> None:
        async with SSHTransport(_target(lab, lab_host)) as ssh:
            await reap_port(ssh, "windows", port, grace=1.0)

    with pytest.raises(ForeignHolder, match=rf"PID {foreign.pid}.*http.server"):
        asyncio.run(reap())
    assert foreign.poll() is None  # never touched


@pytest.mark.llamacpp
@pytest.mark.django_db(transaction=True)
def test_the_rpc_server_step_and_the_reap_job_run_on_a_windows_node(lab, lab_host):
    """The console's own rpc_server step on a Windows node: its log folder under %USERPROFILE%, rpc-server.exe
    started detached, found listening with Get-NetTCPConnection, its banner read from its two log files once
    one connection (TcpClient) made it write them out; then the reap job ends it by PID."""
    drive = windows_like(lab, lab_host)
    drive.install("C:\\llama\\rpc-server.exe", rpc_server_binary())
    # rpc-server.exe is the lab's Linux build, to which the PC's cache folder (C:\...) is a relative path on
    # this machine: these servers run without the cache (tests/lab/test_windows_cache_lab.py has it).
    node = lab_node(lab, lab_host, rpc_cache_limit_gib=0)
    assert run(Job.objects.create(kind="probe", node=node)).state == JobState.SUCCEEDED
    node.refresh_from_db()
    Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        source="C:\\llama",
        rpc_protocol="7.0.0",
        rpc_binary="rpc-server",
        rpc_server_path="C:\\llama\\rpc-server.exe",
        llama_server_path="C:\\llama\\llama-server.exe",
    )
    port = 41000 + secrets.randbelow(9000)
    deployment = step_deployment(node, port=port + 1)
    step = run(
        Job.objects.create(
            kind="rpc_server",
            node=node,
            params={
                "deployment": deployment.pk,
                "args": ["-H", "127.0.0.1", "-p", str(port)],
                "port": port,
                "bind": "127.0.0.1",
                "needs": {"CPU": 1},
            },
        )
    )
    assert step.state == JobState.SUCCEEDED, (step.result, log_text(step))
    log = log_text(step)
    assert "[rpc-server] Starting RPC server v7.0.0" in log
    assert "PS> try { Start-Process -FilePath 'C:\\llama\\rpc-server.exe'" in log
    deployment.refresh_from_db()
    record = deployment.processes[f"rpc-server@{node.name}"]
    pid = record["pid"]
    assert record["log"] == f"{USER_HOME}\\.ramdeck\\run\\d{deployment.pk}-{node.name}-rpc-server-{port}.log"
    assert drive.local(record["log"]).exists()
    assert str(pid) in listeners_in(lab_host, port)
    assert drive.processes[str(pid)].startswith('"C:\\llama\\rpc-server.exe" -H 127.0.0.1')

    reap = run(Job.objects.create(kind="reap", node=node, params={"ports": [port]}))
    assert reap.state == JobState.SUCCEEDED, (reap.result, log_text(reap))
    assert f"reaped rpc-server PID {pid}" in reap.result
    assert listeners_in(lab_host, port) == ""


def test_a_process_started_inside_the_ssh_session_dies_with_it_so_the_console_starts_through_wmi(windows):
    """Windows' OpenSSH ends every process of a session's job object when the session ends (the fake host
    does as well): a bare Start-Process would lose rpc-server.exe as soon as the command returned. The
    transport's start goes through Win32_Process.Create, whose process outlives the session."""
    drive, ssh, run = windows
    drive.install("C:\\llama\\sleeper.exe", Path("/bin/sleep"))
    inside = f"{USER_HOME}\\inside.log"
    run(ssh.run(powershell_argv(start_detached_script(["C:\\llama\\sleeper.exe", "30"], log_path=inside))))
    bare_pid = int(drive.local(pid_file(inside)).read_text())
    assert not run(ssh.pid_alive(bare_pid))

    pid = run(ssh.start_daemon(["C:\\llama\\sleeper.exe", "30"], log_path=f"{USER_HOME}\\outside.log"))
    assert run(ssh.pid_alive(pid))
    assert run(ssh.kill(pid)) and not run(ssh.pid_alive(pid))


@pytest.mark.llamacpp
@pytest.mark.django_db(transaction=True)
def test_an_unpacked_release_folder_is_registered_as_a_windows_nodes_build(lab, lab_host):
    """ "Existing install" on a Windows node: Test-Path finds ggml-rpc-server.exe and llama-server.exe in the
    folder, llama-server.exe --version runs in the foreground, and the rpc-server's banner is read from a
    detached start (its log files removed afterwards). (Building from source: test_windows_build_lab.py.)"""
    tools = require_llamacpp()
    drive = windows_like(lab, lab_host)
    drive.install("C:\\llama\\ggml-rpc-server.exe", tools.rpc_server)
    drive.install("C:\\llama\\llama-server.exe", tools.llama_server)
    drive.add_to_path("C:\\llama")
    node = lab_node(lab, lab_host)
    assert run(Job.objects.create(kind="probe", node=node)).state == JobState.SUCCEEDED
    node.refresh_from_db()
    # The probe found the pair on the PATH (Get-Command): the node page offers to record it.
    assert node.facts["rpc_server_binary"] == "C:\\llama\\ggml-rpc-server.exe"
    assert node.detected_install_dir == "C:\\llama" and node.detected_install_unrecorded

    form = BuildForm(data={"source": "existing", "path": "C:\\llama\\", "backend": "cpu"})
    assert form.is_valid(), form.errors
    job = run(Job.objects.create(kind="build", node=node, params=form.params()))

    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job))
    build = Build.objects.get(node=node)
    assert (build.source_kind, build.rpc_protocol, build.backend) == (BuildSource.EXISTING, "7.0.0", "cpu")
    assert build.rpc_server_path == "C:\\llama\\ggml-rpc-server.exe"
    assert build.llama_server_path == "C:\\llama\\llama-server.exe"
    assert build.version
    assert not node.detected_install_unrecorded
    run_folder = drive.local(f"{USER_HOME}\\.ramdeck\\run")
    assert list(run_folder.iterdir()) == []  # the banner's log, .err and .pid removed


def _namespace_rules(host) -> str:
    return subprocess.run(
        host.exec_argv(["iptables", "-w", "-S", "INPUT"]), capture_output=True, text=True, timeout=30
    ).stdout


@pytest.mark.llamacpp
@pytest.mark.django_db(transaction=True)
def test_direct_mode_opens_the_windows_firewall_to_the_coordinator_only_and_the_stop_closes_it(lab, lab_host):
    """An administrator login: a Block rule for every address but the coordinator's and an Allow rule for
    it go in before rpc-server.exe starts (the fake host applies the Block rule as iptables REJECT rules in
    its namespace), and the stop step removes both. A login that is not an administrator runs unfenced,
    saying why."""
    drive = windows_like(lab, lab_host)
    drive.install("C:\\llama\\rpc-server.exe", rpc_server_binary())
    # rpc-server.exe is the lab's Linux build, to which the PC's cache folder (C:\...) is a relative path on
    # this machine: these servers run without the cache (tests/lab/test_windows_cache_lab.py has it).
    node = lab_node(lab, lab_host, rpc_cache_limit_gib=0)
    assert run(Job.objects.create(kind="probe", node=node)).state == JobState.SUCCEEDED
    Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        rpc_protocol="7.0.0",
        rpc_binary="rpc-server",
        rpc_server_path="C:\\llama\\rpc-server.exe",
        llama_server_path="C:\\llama\\llama-server.exe",
    )
    port = 41000 + secrets.randbelow(9000)
    deployment = step_deployment(node, port=port + 1)
    tag = rpc_guard.tag_for(deployment.pk, node.name)
    params = {
        "deployment": deployment.pk,
        "args": ["-H", lab_host.address, "-p", str(port)],
        "port": port,
        "bind": lab_host.address,
        "needs": {"CPU": 1},
        "firewall": {"coordinator": lab_host.host_address, "tag": tag},
    }
    step = run(Job.objects.create(kind="rpc_server", node=node, params=params))

    assert step.state == JobState.SUCCEEDED, (step.result, log_text(step))
    assert f"admitting only {lab_host.host_address}" in step.result
    rules = _namespace_rules(lab_host)
    before, after = lab_host.host_address.rsplit(".", 1)[0], int(lab_host.host_address.rsplit(".", 1)[1])
    assert f"--src-range 0.0.0.0-{before}.{after - 1}" in rules and f"--dport {port}" in rules, rules
    assert f"--src-range {before}.{after + 1}-255.255.255.255" in rules, rules
    # The coordinator (this machine's side of the lab link) still reaches the server.
    socket.create_connection((lab_host.address, port), timeout=5).close()
    deployment.refresh_from_db()
    server = deployment.processes[f"rpc-server@{node.name}"]
    stop = run(
        Job.objects.create(
            kind="stop",
            node=node,
            params={
                "deployment": deployment.pk,
                "processes": [server],
                "guards": list(deployment.guards.values()),
            },
        )
    )
    assert stop.state == JobState.SUCCEEDED, (stop.result, log_text(stop))
    assert tag not in _namespace_rules(lab_host)
    assert listeners_in(lab_host, port) == ""

    # Not an administrator: no rule, and the log says why.
    state = json.loads((drive.root / "state.json").read_text())
    state["admin"] = False
    (drive.root / "state.json").write_text(json.dumps(state))
    again = run(
        Job.objects.create(
            kind="rpc_server",
            node=node,
            params={**params, "port": port + 2, "args": ["-H", lab_host.address, "-p", str(port + 2)]},
        )
    )
    assert again.state == JobState.SUCCEEDED, (again.result, log_text(again))
    assert "not an administrator of this Windows PC" in again.result
    assert tag not in _namespace_rules(lab_host)
    run(Job.objects.create(kind="reap", node=node, params={"ports": [port + 2]}))


# --- review findings: the shell follows what the node answered; failures say why ---------------------------


@pytest.mark.django_db(transaction=True)
def test_a_node_set_to_linux_whose_sshd_answers_in_powershell_gets_powershell_commands(lab, lab_host):
    """The operator's platform setting says Linux; the first connection found PowerShell, and the probe a
    Windows PC: from then on the node is Windows for every command the console builds (a second probe,
    with the shell known from the first, runs the PowerShell probe again), and the probe says the setting
    is off."""
    windows_like(lab, lab_host)
    node = lab_node(lab, lab_host, platform_hint="linux")
    probe = run(Job.objects.create(kind="probe", node=node))
    assert probe.state == JobState.SUCCEEDED, (probe.result, log_text(probe))
    node.refresh_from_db()
    assert (node.platform, shell_for(node)) == ("windows", "windows")
    assert any(
        "set to linux, but its SSH server answered with powershell" in w for w in node.facts["warnings"]
    )
    again = run(Job.objects.create(kind="probe", node=node))
    assert again.state == JobState.SUCCEEDED, (again.result, log_text(again))
    node.refresh_from_db()
    assert node.facts["hostname"] == "GAMING-PC"


def test_a_detached_start_of_a_missing_program_says_what_start_process_said(windows):
    _, ssh, run = windows
    log = f"{USER_HOME}\\missing-{secrets.token_hex(4)}.log"
    with pytest.raises(TransportError) as failed:
        run(ssh.start_daemon(["C:\\llama\\no-such-rpc-server.exe", "-p", "1"], log_path=log))
    message = str(failed.value)
    assert (
        "Start-Process said: This command cannot be run due to the error: The system cannot find the file"
        in (message)
    ), message
    assert "15 s" not in message


def test_a_detached_start_of_a_program_windows_cannot_run_says_so(windows):
    drive, ssh, run = windows
    # A file that is not a program (no execute permission in the lab: CreateProcess's "Access is denied").
    target = drive.local("C:\\llama\\notes.exe")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("not a program\n")
    with pytest.raises(TransportError, match=r"Start-Process said: .*Access is denied"):
        run(ssh.start_daemon(["C:\\llama\\notes.exe"], log_path=f"{USER_HOME}\\notes.log"))


def test_a_start_that_wmi_refuses_names_its_return_value(windows):
    drive, ssh, run = windows
    state = json.loads((drive.root / "state.json").read_text())
    state["wmi_create_answer"] = 2
    (drive.root / "state.json").write_text(json.dumps(state))
    with pytest.raises(TransportError, match=r"Win32_Process\.Create answered 2 \(Access denied\)"):
        run(ssh.start_daemon(["C:\\Windows\\System32\\echo-argv.exe"], log_path=f"{USER_HOME}\\x.log"))


def test_the_monitor_reads_a_dead_windows_servers_log_with_get_content(lab, lab_host, windows):
    """A dead rpc-server.exe's last log lines reach the deployment's reason through PowerShell's
    Get-Content -Tail (its stdout log and its .err), not `tail`, which Windows does not have."""
    from deployments.monitor import _check_node

    drive, _, _ = windows
    log = f"{USER_HOME}\\.ramdeck\\run\\d1-pc-rpc-server-50052.log"
    drive.local(log).parent.mkdir(parents=True, exist_ok=True)
    drive.local(log).write_text("\r\n".join(f"line {n}" for n in range(40)) + "\r\n")
    drive.local(log + ".err").write_text("ggml_backend_cuda_init: out of memory\r\n")

    class PC:
        name = "gaming-pc"
        platform = "windows"

    dead_pid = 4_000_000  # above Linux's pid_max: never alive
    processes = [{"pid": dead_pid, "role": "rpc-server", "log": log}]
    dead, rows = asyncio.run(_check_node(PC(), SSHTransport(_target(lab, lab_host)), processes))
    reason = dead[dead_pid]
    assert "rpc-server on gaming-pc (PID 4000000) is not running. Last log lines:" in reason
    assert "line 39" in reason and "line 20" not in reason
    assert "out of memory" in reason
    assert "is not recognized" not in reason
    assert rows[0]["alive"] is False


@pytest.mark.django_db(transaction=True)
def test_the_probe_finds_an_intel_gpu_through_vulkaninfo_on_windows(lab, lab_host):
    """vulkaninfo.exe (the Intel driver's Vulkan runtime) and Win32_VideoController through real SSH: the
    integrated GPU is Vulkan0, sharing the PC's RAM in place of the CPU device."""
    video = json.loads((DATA / "probe" / "windows_video_controllers.json").read_text())[
        "intel_iris_xe_laptop"
    ]
    vulkaninfo = (DATA / "probe" / "windows_vulkaninfo_summary_intel_iris_xe.txt").read_text()
    windows_like(lab, lab_host, vulkaninfo=vulkaninfo, video=video)
    node = lab_node(lab, lab_host)
    probe = run(Job.objects.create(kind="probe", node=node))
    assert probe.state == JobState.SUCCEEDED, (probe.result, log_text(probe))
    [gpu] = node.devices.all()
    assert (gpu.name, gpu.kind, gpu.description) == (
        "Vulkan0",
        DeviceKind.VULKAN,
        "Intel(R) Iris(R) Xe Graphics",
    )
    assert gpu.unified_memory and gpu.total_bytes == 33473476 * 1024


_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()"


def _connect_from(host, address: str, port: int) -> subprocess.CompletedProcess:
    """One TCP connection from inside `host`'s namespace (a LAN machine that is not the coordinator)."""
    return subprocess.run(
        host.exec_argv([sys.executable, "-c", _CONNECT, address, str(port)]),
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.llamacpp
@pytest.mark.django_db(transaction=True)
def test_the_windows_firewall_rule_refuses_a_machine_that_is_not_the_coordinator(lab, lab_hosts, tmp_path):
    """Direct mode on a Windows worker: with the rules in, the coordinator (this machine's side of the lab
    link) connects to rpc-server.exe and another machine of the LAN (a second lab namespace, routed to the
    PC) is refused; the stop removes the rules, after which that machine reaches a server on the port."""
    pc_host, outsider = lab_hosts(2)
    route_between([pc_host, outsider])
    drive = windows_like(lab, pc_host)
    drive.install("C:\\llama\\rpc-server.exe", rpc_server_binary())
    # rpc-server.exe is the lab's Linux build, to which the PC's cache folder (C:\...) is a relative path on
    # this machine: these servers run without the cache (tests/lab/test_windows_cache_lab.py has it).
    node = lab_node(lab, pc_host, rpc_cache_limit_gib=0)
    assert run(Job.objects.create(kind="probe", node=node)).state == JobState.SUCCEEDED
    Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        rpc_protocol="7.0.0",
        rpc_binary="rpc-server",
        rpc_server_path="C:\\llama\\rpc-server.exe",
        llama_server_path="C:\\llama\\llama-server.exe",
    )
    port = 41000 + secrets.randbelow(9000)
    deployment = step_deployment(node, port=port + 1)
    tag = rpc_guard.tag_for(deployment.pk, node.name)
    step = run(
        Job.objects.create(
            kind="rpc_server",
            node=node,
            params={
                "deployment": deployment.pk,
                "args": ["-H", pc_host.address, "-p", str(port)],
                "port": port,
                "bind": pc_host.address,
                "needs": {"CPU": 1},
                "firewall": {"coordinator": pc_host.host_address, "tag": tag},
            },
        )
    )
    assert step.state == JobState.SUCCEEDED, (step.result, log_text(step))
    assert f"admitting only {pc_host.host_address}" in step.result

    socket.create_connection((pc_host.address, port), timeout=5).close()  # the coordinator
    refused = _connect_from(outsider, pc_host.address, port)
    assert refused.returncode != 0 and "ConnectionRefusedError" in refused.stderr, refused.stderr

    deployment.refresh_from_db()
    stop = run(
        Job.objects.create(
            kind="stop",
            node=node,
            params={
                "deployment": deployment.pk,
                "processes": [deployment.processes[f"rpc-server@{node.name}"]],
                "guards": list(deployment.guards.values()),
            },
        )
    )
    assert stop.state == JobState.SUCCEEDED, (stop.result, log_text(stop))
    assert tag not in _namespace_rules(pc_host)
    # The rules are gone: a server on the same port is open to that machine again.
    server = start_in(
        pc_host, [sys.executable, "-m", "http.server", "-b", pc_host.address, str(port)], tmp_path / "h.log"
    )
    for _ in range(100):
        if listeners_in(pc_host, port):
            break
        time.sleep(0.1)
    reached = _connect_from(outsider, pc_host.address, port)
    assert reached.returncode == 0, reached.stderr
    server.kill()
