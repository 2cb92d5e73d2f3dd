"""The runner over real SSH: a lab host (its own network namespace and sshd) runs the job's commands.

The transport's own faults are tested in test_ssh_transport.py; here the question is what the JOB ends
as, what its log holds, and what reaches a watcher on the channel layer.
"""

from __future__ import annotations

import threading

import pytest

from jobs import broadcast, runner
from jobs.broadcast import call_sync
from jobs.models import Job, JobLogLine, JobState
from nodes.models import CredentialKind
from tests.factories import CredentialFactory, NodeFactory
from tests.job_fixtures import log_of, make_command_job, receive_all, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


@pytest.fixture(autouse=True)
def fast_failure_detection(settings, channel_layer):
    # Keepalive every second: a vanished node is noticed in seconds, not minutes.
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0
    settings.RAMDECK_SSH_KEEPALIVE_S = 1.0


def ssh_node(lab, host, **fields):
    credential = CredentialFactory(kind=CredentialKind.PRIVATE_KEY, secret=lab.client_private_key)
    options = {"address": host.address, "ssh_user": "root", "host_key": host.host_public_key, **fields}
    return NodeFactory(credential=credential, **options)


def out_texts(job: Job) -> list[str]:
    return list(
        JobLogLine.objects.filter(job=job, stream="out")
        .order_by("seq")
        .values_list("text", flat=True)
        .iterator()
    )


def test_two_hundred_thousand_lines_over_ssh_are_stored_and_sent_in_order(lab, lab_host, channel_layer):
    job = make_command_job(ssh_node(lab, lab_host), ["seq", "0", "199999"])
    channel = call_sync(channel_layer.new_channel)
    call_sync(channel_layer.group_add, broadcast.group_name(job.pk), channel)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.result
    assert out_texts(job) == [str(i) for i in range(200_000)]
    seqs = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", flat=True).iterator())
    assert seqs == list(range(len(seqs)))
    messages = [m for m in receive_all(channel_layer, channel) if m["type"] == "job.lines"]
    assert [m["first"] + i for m in messages for i in range(len(m["lines"]))] == seqs


def test_nul_bytes_and_invalid_utf8_over_ssh_are_stored_readably(lab, lab_host):
    script = r"printf 'a\000b\n\377\376 x\n'"
    job = make_command_job(ssh_node(lab, lab_host), ["sh", "-c", script])
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.result
    assert out_texts(job) == ["ab", "\ufffd\ufffd x"]


def test_a_failing_remote_command_is_failed_and_a_missing_one_errored(lab, lab_host):
    node = ssh_node(lab, lab_host)
    failing = make_command_job(node, ["sh", "-c", "echo no disk space >&2; exit 4"])
    missing = make_command_job(node, ["ramdeck-no-such-tool"])
    runner.run_job(failing.pk)
    runner.run_job(missing.pk)
    failing.refresh_from_db()
    missing.refresh_from_db()
    assert (failing.state, failing.exit_code) == (JobState.FAILED, 4)
    assert missing.state == JobState.ERRORED and "ramdeck-no-such-tool" in missing.result
    assert "not found" in missing.result


def test_cancelling_an_ssh_job_ends_the_remote_process_by_its_pid(lab, lab_host):
    node = ssh_node(lab, lab_host)
    job = make_command_job(node, ["sh", "-c", "echo ready; exec sleep 600"])
    thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: "ready" in out_texts(job), what="the remote command to start")
        pid = wait_for(lambda: Job.objects.get(pk=job.pk).remote_pid, what="the remote PID")
        Job.objects.get(pk=job.pk).request_cancel()
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        Job.objects.filter(pk=job.pk).update(cancel_requested=True)
        thread.join(timeout=30)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    # The process lived in the lab host's namespace; ask the node itself whether it is gone.
    check = make_command_job(node, ["sh", "-c", f"kill -0 {pid} 2>/dev/null && echo alive || echo gone"])
    runner.run_job(check.pk)
    assert out_texts(check) == ["gone"]


def test_a_node_that_goes_away_mid_job_ends_errored_with_a_reason(lab, lab_host):
    job = make_command_job(ssh_node(lab, lab_host), ["sh", "-c", "echo started; sleep 600"])
    thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: "started" in out_texts(job), what="the remote command to start")
        lab.link_down(lab_host)
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        lab.link_up(lab_host)
        thread.join(timeout=30)
    job.refresh_from_db()
    assert job.state == JobState.ERRORED
    assert "connection to" in job.result and "was lost" in job.result
    assert [text for _, _, text in log_of(job)][-1] == f"Errored: {job.result}"


def test_a_node_whose_host_key_is_not_approved_runs_nothing(lab, lab_host):
    node = ssh_node(lab, lab_host, host_key="")
    job = make_command_job(node, ["touch", "/tmp/should-not-exist"])
    runner.run_job(job.pk)
    job.refresh_from_db()
    node.refresh_from_db()
    assert job.state == JobState.NEEDS_APPROVAL
    assert "no admin has approved" in job.result
    assert node.pending_host_key == lab_host.host_public_key
