"""The reaper against real processes on a lab host over real sshd: ours are ended by PID, others never."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from jobs.models import Job, JobState
from tests.deploy_fixtures import (
    lab_node,
    listeners_in,
    log_text,
    pid_alive,
    rpc_server_binary,
    run,
    start_in,
    stop_proc,
    wait_listening,
)

pytestmark = [
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.timeout(180),
    pytest.mark.django_db(transaction=True),
]

PORT = 50052


@pytest.fixture
def host_node(lab, lab_host):
    return lab_host, lab_node(lab, lab_host), rpc_server_binary()


def test_a_stale_rpc_server_holding_the_port_is_reaped_by_pid(host_node, tmp_path):
    host, node, rpc_server = host_node
    stale = start_in(host, [str(rpc_server), "-H", host.address, "-p", str(PORT)], tmp_path / "stale.log")
    try:
        assert f"pid={stale.pid}" in wait_listening(host, PORT)
        job = run(Job.objects.create(kind="reap", node=node, params={"ports": [PORT]}))
        assert job.state == JobState.SUCCEEDED, job.result
        stale.wait(timeout=10)
        assert not pid_alive(stale.pid)
        assert listeners_in(host, PORT) == ""
        assert f"PID {stale.pid}" in log_text(job)
        assert f"reaped rpc-server PID {stale.pid}" in job.result
        event = AuditEvent.objects.get(action="process.reaped")
        assert event.changes["pid"] == stale.pid
        assert event.changes["port"] == PORT
        assert event.object_repr == node.name
    finally:
        stop_proc(stale)


def test_a_free_port_is_reported_free_and_nothing_is_killed(host_node):
    host, node, _ = host_node
    job = run(Job.objects.create(kind="reap", node=node, params={"ports": [PORT]}))
    assert job.state == JobState.SUCCEEDED, job.result
    assert "was free" in job.result
    assert not AuditEvent.objects.filter(action="process.reaped").exists()


def test_a_foreign_process_is_never_killed_and_the_job_fails_naming_it(host_node, tmp_path):
    host, node, _ = host_node
    foreign = start_in(
        host, ["python3", "-m", "http.server", str(PORT), "--bind", host.address], tmp_path / "foreign.log"
    )
    try:
        wait_listening(host, PORT)
        job = run(Job.objects.create(kind="reap", node=node, params={"ports": [PORT]}))
        assert job.state == JobState.FAILED
        assert "python3" in job.result
        assert "http.server" in job.result
        assert f"PID {foreign.pid}" in job.result
        assert pid_alive(foreign.pid)
        assert foreign.poll() is None
        assert not AuditEvent.objects.filter(action="process.reaped").exists()
    finally:
        stop_proc(foreign)


def test_the_periodic_scan_lists_a_stale_rpc_server_and_one_click_reaps_it(
    host_node, tmp_path, client, monkeypatch
):
    from django.urls import reverse

    from deployments.models import StaleProcess
    from deployments.monitor import scan_stale
    from tests.factories import UserFactory

    host, node, rpc_server = host_node
    stale = start_in(host, [str(rpc_server), "-H", host.address, "-p", str(PORT)], tmp_path / "stale.log")
    try:
        wait_listening(host, PORT)
        assert scan_stale() == 1
        row = StaleProcess.objects.get()
        assert (row.node, row.port, row.pid, row.program) == (node, PORT, stale.pid, "rpc-server")
        client.force_login(UserFactory(username="oscar", role="operator"))
        assert str(stale.pid) in client.get(reverse("deployments:stale")).content.decode()
        monkeypatch.setattr(Job, "send_to_worker", lambda job: None)
        response = client.post(reverse("deployments:stale_reap", args=[row.pk]))
        job = run(Job.objects.get(kind="reap"))
        assert response.url == job.get_absolute_url()
        assert job.state == JobState.SUCCEEDED, job.result
        stale.wait(timeout=10)
        assert scan_stale() == 0
        assert not StaleProcess.objects.exists()
    finally:
        stop_proc(stale)
