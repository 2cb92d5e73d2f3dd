"""The whole Mac command path through real SSH, on a lab host that has only the tools a stock Mac has
(tests/lab/mac_tools.py): the probe takes its macOS branch, an existing install is registered with its
banner read, ggml-rpc-server starts detached and its banner is read from its log, its listener is found
with lsof, and the reaper ends it by PID. A GNU-only command anywhere on that path fails there, as on a
Mac."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from builds.models import Build, BuildSource
from jobs.models import Job, JobState
from nodes.models import DeviceKind
from nodes.transports import transport_for
from remote.base import TransportError
from tests.deploy_fixtures import (
    lab_node,
    listeners_in,
    log_text,
    pid_alive,
    rpc_server_binary,
    run,
    step_deployment,
)
from tests.lab.mac_tools import HIDDEN, mac_like

pytestmark = [
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.timeout(240),
    pytest.mark.django_db(transaction=True),
]


async def _not_found(node, argv: list[str]) -> str:
    async with transport_for(node) as ssh:
        try:
            await ssh.run(argv, timeout=30)
        except TransportError as exc:
            return str(exc)
    return ""


def test_the_mac_command_path_runs_where_only_a_macs_tools_are(lab, lab_host):
    rpc_server = rpc_server_binary()
    mac_like(lab, lab_host)
    node = lab_node(lab, lab_host)

    # The host really lacks the GNU tools: each one is "not found" there, as on a Mac.
    for tool in ("timeout", "stdbuf", "setsid", "ss"):
        assert tool in HIDDEN
        assert "was not found" in asyncio.run(_not_found(node, [tool, "--version"]))

    # The probe: its macOS branch (sw_vers, sysctl, vm_stat, system_profiler, lsof).
    probe = run(Job.objects.create(kind="probe", node=node))
    assert probe.state == JobState.SUCCEEDED, (probe.result, log_text(probe))
    node.refresh_from_db()
    assert node.platform == "macos"
    assert node.devices.filter(kind=DeviceKind.METAL).exists()

    # "Existing install": the banner read starts the real rpc-server detached and reads its protocol.
    build_job = run(
        Job.objects.create(
            kind="build", node=node, params={"source": "existing", "path": str(rpc_server.parent)}
        )
    )
    assert build_job.state == JobState.SUCCEEDED, (build_job.result, log_text(build_job))
    build = Build.objects.get(node=node)
    assert (build.source_kind, build.rpc_protocol) == (BuildSource.EXISTING, "7.0.0")
    assert "Started" in log_text(build_job)  # detached with its PID recorded, then ended

    # The rpc_server step: detached with nohup (no setsid, no stdbuf), found listening with lsof, and its
    # banner read from its log, which only a connection makes the server write without stdbuf.
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
    assert "no stdbuf here to line-buffer it" in log_text(step)
    assert "[rpc-server] Starting RPC server v7.0.0" in log_text(step)
    deployment.refresh_from_db()
    pid = deployment.processes[f"rpc-server@{node.name}"]["pid"]
    assert str(pid) in listeners_in(lab_host, port)

    # The reaper finds it with lsof and ends it by PID.
    reap = run(Job.objects.create(kind="reap", node=node, params={"ports": [port]}))
    assert reap.state == JobState.SUCCEEDED, (reap.result, log_text(reap))
    assert f"reaped rpc-server PID {pid}" in reap.result
    assert not pid_alive(pid)
    assert listeners_in(lab_host, port) == ""
