"""The probe job end to end: a lab host through real SSH (and the console's own host through the local
transport), through the real runner, into Node and Device rows."""

from __future__ import annotations

import psutil
import pytest

from jobs import runner
from jobs.models import Job, JobState
from nodes import tasks as node_tasks
from nodes.models import CredentialKind, Device, DeviceKind, Reachability, Transport
from nodes.probe.job import start_probe
from tests.factories import CredentialFactory, DeviceFactory, NodeFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

MIB = 1024**2


@pytest.fixture(autouse=True)
def fast_ssh_and_private_channels(settings, channel_layer):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0


def lab_node(lab, host, *, approved: bool = True, **fields):
    credential = CredentialFactory(kind=CredentialKind.PRIVATE_KEY, secret=lab.client_private_key)
    return NodeFactory(
        address=host.address,
        ssh_user="root",
        credential=credential,
        host_key=host.host_public_key if approved else "",
        **fields,
    )


def probe_job(node) -> Job:
    return Job.objects.create(kind="probe", node=node, title=f"Probe {node.name}")


def assert_sane_cpu(device: Device) -> None:
    # The lab host shares this machine's kernel, so its RAM is this machine's RAM.
    assert device.kind == DeviceKind.CPU and not device.unified_memory
    assert device.total_bytes == pytest.approx(psutil.virtual_memory().total, rel=0.02)
    assert 64 * MIB < device.free_bytes <= device.total_bytes
    assert device.bandwidth_gbs and device.bandwidth_gbs > 0


@pytest.mark.lab
def test_probing_a_lab_host_over_ssh_stores_its_cpu_device_and_facts(lab, lab_host):
    node = lab_node(lab, lab_host)
    job = probe_job(node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    node.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.result
    assert "CPU" in job.result and "RTT" in job.result
    assert node.reachability == Reachability.REACHABLE
    assert node.last_seen_at and node.last_probe_at and node.last_error == ""
    assert node.rtt_ms is not None and node.rtt_ms > 0
    assert node.facts["platform"] == "linux"
    assert node.facts["cpu_cores"] >= 1 and node.facts["kernel"]
    assert node.facts["rpc_port"] == node.rpc_port and node.facts["rpc_port_in_use"] is False
    [cpu] = node.devices.all()
    assert cpu.name == "CPU"
    assert_sane_cpu(cpu)
    log = "\n".join(job.log_lines.values_list("text", flat=True))
    assert "Device CPU:" in log and "Round trip:" in log


@pytest.mark.lab
def test_a_probe_keeps_operator_overrides_and_drops_devices_that_are_gone(lab, lab_host):
    node = lab_node(lab, lab_host)
    DeviceFactory(node=node, name="CPU", bandwidth_override_gbs=12.5, measured_bandwidth_gbs=9.0)
    DeviceFactory(node=node, name="CUDA0", kind=DeviceKind.CUDA)
    runner.run_job(probe_job(node).pk)
    [cpu] = node.devices.all()
    assert (cpu.bandwidth_override_gbs, cpu.measured_bandwidth_gbs) == (12.5, 9.0)
    assert cpu.effective_bandwidth_gbs == 12.5
    assert_sane_cpu(cpu)


@pytest.mark.lab
def test_the_first_probe_of_a_new_node_records_its_key_and_runs_nothing(lab, lab_host):
    node = lab_node(lab, lab_host, approved=False)
    job = probe_job(node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    node.refresh_from_db()
    # Not an error: nothing went wrong, an admin has a key to look at (the job page shows it).
    assert job.state == JobState.NEEDS_APPROVAL
    assert "no admin has approved" in job.result
    assert node.reachability == Reachability.HOST_KEY_PENDING
    assert node.pending_host_key == lab_host.host_public_key
    assert not node.devices.exists()
    assert "Accepted " not in (lab_host.workdir / "sshd.log").read_text()


@pytest.mark.lab
def test_a_node_that_does_not_answer_is_marked_unreachable_with_the_reason(lab, lab_host):
    node = lab_node(lab, lab_host)
    DeviceFactory(node=node, name="CPU")
    lab.link_down(lab_host)
    job = probe_job(node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    node.refresh_from_db()
    assert job.state == JobState.ERRORED
    assert "did not answer within 3 s" in job.result
    assert node.reachability == Reachability.UNREACHABLE
    assert "did not answer" in node.last_error
    assert node.devices.count() == 1  # The last known hardware stays, marked by the node's state.


def test_probing_the_consoles_own_host_uses_the_local_transport(local_node):
    job = probe_job(local_node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.result
    cpu = local_node.devices.get(name="CPU")
    assert cpu.total_bytes == psutil.virtual_memory().total
    assert 0 < cpu.free_bytes <= cpu.total_bytes
    local_node.refresh_from_db()
    assert local_node.rtt_ms == 0.0 and local_node.reachability == Reachability.REACHABLE


def test_a_node_set_to_windows_that_answers_with_a_posix_shell_fails_with_advice(local_node):
    local_node.platform_hint = "windows"
    local_node.save()
    job = probe_job(local_node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "WSL2" in job.result


def test_beat_queues_one_probe_per_enabled_node_without_a_pending_key(monkeypatch, transactional_db):
    sent: list[int] = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: sent.append(job.pk))
    ready = NodeFactory()
    NodeFactory(enabled=False)
    NodeFactory(pending_host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG")
    busy = NodeFactory()
    start_probe(busy)
    sent.clear()

    created = node_tasks.probe_all_nodes()

    assert [Job.objects.get(pk=pk).node for pk in created] == [ready]
    assert sent == created
    assert Job.objects.filter(node=busy, kind="probe").count() == 1


def test_start_probe_does_not_queue_a_second_probe_while_one_is_active(monkeypatch, transactional_db):
    monkeypatch.setattr(Job, "send_to_worker", lambda job: None)
    node = NodeFactory(transport=Transport.LOCAL)
    assert start_probe(node) is not None
    assert start_probe(node) is None


@pytest.mark.lab
def test_a_changed_host_key_blocks_probes_until_an_admin_approves_it(
    lab, lab_host, admin_client, monkeypatch
):
    from django.urls import reverse

    # The approval queues a probe; we run it here.
    monkeypatch.setattr(Job, "send_to_worker", lambda job: None)
    node = lab_node(lab, lab_host)
    lab.start_sshd(lab_host, new_host_key=True)  # Reinstalled, or someone in the middle.
    blocked = probe_job(node)
    runner.run_job(blocked.pk)
    blocked.refresh_from_db()
    node.refresh_from_db()
    assert blocked.state == JobState.NEEDS_APPROVAL and "CHANGED" in blocked.result
    assert node.reachability == Reachability.HOST_KEY_CHANGED
    assert node_tasks.probe_all_nodes() == []  # Beat leaves a blocked node alone.

    admin_client.post(
        reverse("nodes:approve_host_key", args=[node.name]),
        {"fingerprint": node.pending_host_key_fingerprint},
    )
    node.refresh_from_db()
    assert node.host_key == lab_host.host_public_key
    queued = Job.objects.get(node=node, kind="probe", state=JobState.QUEUED)
    runner.run_job(queued.pk)
    queued.refresh_from_db()
    assert queued.state == JobState.SUCCEEDED, queued.result
    node.refresh_from_db()
    assert node.reachability == Reachability.REACHABLE


@pytest.mark.lab
async def test_the_probe_names_the_process_holding_the_rpc_port(lab, lab_host):
    from nodes.probe.collect import collect
    from remote.ssh import SSHTarget, SSHTransport

    target = SSHTarget(
        host=lab_host.address, private_key=lab.client_private_key, pinned_host_key=lab_host.host_public_key
    )
    async with SSHTransport(target) as ssh:
        free = await collect(ssh, "auto", rpc_port=50052)
        holder = await ssh.start_daemon(
            ["python3", "-m", "http.server", "50052", "--bind", lab_host.address],
            log_path=str(lab_host.workdir / "holder.log"),
        )
        for _ in range(100):  # Until it listens (a hang guard, not a timing assertion).
            if (await ssh.run(["sh", "-c", "ss -ltnH | grep -q ':50052 '"])).ok:
                break
        busy = await collect(ssh, "auto", rpc_port=50052)
        await ssh.kill(holder, grace=1.0)
    assert not free.rpc_port_in_use
    assert busy.rpc_port_in_use
    assert (busy.rpc_port_pid, busy.rpc_port_process) == (holder, "python3")
