"""The job runner against real components: local subprocesses through LocalTransport, the real database,
and the real Redis channel layer."""

from __future__ import annotations

import threading

import pytest

from jobs import broadcast, logwriter, runner
from jobs.broadcast import call_sync
from jobs.models import Job, JobLogLine, JobState
from tests.job_fixtures import (
    log_of,
    make_command_job,
    pid_running,
    python_job,
    receive_all,
    wait_for,
)

pytestmark = pytest.mark.django_db(transaction=True)


def out_lines(job: Job) -> list[str]:
    return [text for _, stream, text in log_of(job) if stream == "out"]


def test_a_local_command_runs_and_its_output_is_stored_in_order(local_node, channel_layer):
    job = python_job(local_node, "import sys\nprint('hello')\nprint('oops', file=sys.stderr)\nprint('bye')")
    runner.run_job(job.pk, worker="test-worker")
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert job.exit_code == 0
    assert job.worker == "test-worker"
    assert job.started_at and job.finished_at and job.heartbeat_at
    assert job.remote_pid is None  # Cleared once the command ended.
    log = log_of(job)
    assert [seq for seq, _, _ in log] == list(range(len(log)))
    assert log[0][1] == "sys" and log[0][2].startswith("$ ")
    assert out_lines(job) == ["hello", "bye"]
    assert ("err", "oops") in [(stream, text) for _, stream, text in log]
    assert log[-1][1:] == ("sys", f"Succeeded: {job.result}")


def test_lines_are_sent_to_the_job_group_after_they_are_saved(local_node, channel_layer):
    job = python_job(local_node, "for i in range(5000): print('line', i)")
    channel = call_sync(channel_layer.new_channel)
    call_sync(channel_layer.group_add, broadcast.group_name(job.pk), channel)
    runner.run_job(job.pk)
    messages = receive_all(channel_layer, channel)
    batches = [m for m in messages if m["type"] == "job.lines"]
    sent = [m["first"] + i for m in batches for i in range(len(m["lines"]))]
    stored = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", flat=True))
    assert sent == stored  # Every saved line, once, in order.
    lines = [line for m in batches for line in m["lines"]]
    assert lines[1] == ["out", "line 0"]  # data, not markup: the consumers render it
    states = [m["state"] for m in messages if m["type"] == "job.status"]
    assert states == ["running", "succeeded"]
    # Output is sent in bounded batches, not one message per line nor all of it at the end.
    sizes = [len(m["lines"]) for m in batches]
    assert len(sizes) >= 3 and len(sizes) < 5002 and max(sizes) <= logwriter.MAX_BATCH_LINES


def test_a_redelivered_task_does_nothing(local_node, channel_layer, tmp_path):
    marker = tmp_path / "ran"
    job = python_job(local_node, f"open({str(marker)!r}, 'a').write('ran\\n')")
    runner.run_job(job.pk)
    job.refresh_from_db()
    first = (job.state, job.started_at, job.finished_at, job.next_seq)
    runner.run_job(job.pk)  # The same task delivered again.
    job.refresh_from_db()
    assert (job.state, job.started_at, job.finished_at, job.next_seq) == first
    assert marker.read_text() == "ran\n"


def test_a_non_zero_exit_is_failed_with_its_exit_code(local_node, channel_layer):
    job = python_job(local_node, "import sys; print('bad input'); sys.exit(3)")
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.exit_code == 3
    assert "exited with status 3" in job.result


def test_a_command_that_does_not_exist_is_errored_with_an_actionable_reason(local_node, channel_layer):
    job = make_command_job(local_node, ["ramdeck-no-such-program", "--help"])
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.ERRORED
    assert "ramdeck-no-such-program" in job.result and "not found" in job.result


def test_a_job_without_argv_fails(local_node, channel_layer):
    job = Job.objects.create(kind="command", node=local_node, params={})
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "no command" in job.result


async def exploding_body(ctx) -> str:
    await ctx.log("about to break")
    raise RuntimeError("the flux capacitor is missing")


async def daemon_body(ctx) -> str:
    pid = await ctx.start_daemon(["sleep", "300"], log_path=ctx.job.params["log_path"])
    return f"daemon {pid}"


def test_an_unexpected_exception_is_errored_and_its_traceback_is_in_the_log(
    local_node, channel_layer, job_kind
):
    job_kind("test-explode", exploding_body)
    job = Job.objects.create(kind="test-explode", node=local_node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.ERRORED
    assert job.result == "Internal error: RuntimeError: the flux capacitor is missing"
    texts = [text for _, stream, text in log_of(job) if stream == "sys"]
    assert "about to break" in texts
    assert any(text.startswith("Traceback (most recent call last)") for text in texts)


def test_an_unknown_kind_is_errored(local_node, channel_layer):
    job = Job.objects.create(kind="no-such-kind", node=local_node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.ERRORED
    assert "does not know how to run a 'no-such-kind' job" in job.result


def test_a_daemon_started_by_a_job_is_recorded_by_pid(local_node, channel_layer, job_kind, tmp_path):
    job_kind("test-daemon", daemon_body, adopt_on_loss=True)
    job = Job.objects.create(
        kind="test-daemon", node=local_node, params={"log_path": str(tmp_path / "d.log")}
    )
    runner.run_job(job.pk)
    job.refresh_from_db()
    try:
        assert job.state == JobState.SUCCEEDED
        assert job.remote_pid and job.result == f"daemon {job.remote_pid}"
        assert pid_running(job.remote_pid)  # It outlives the job, as a daemon should.
    finally:
        if job.remote_pid and pid_running(job.remote_pid):
            import os
            import signal

            os.kill(job.remote_pid, signal.SIGKILL)


def test_cancel_ends_the_running_process_by_its_pid(local_node, channel_layer):
    job = python_job(local_node, "import time\nprint('ready', flush=True)\ntime.sleep(300)")
    thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: "ready" in out_lines(job), what="the command to start")
        pid = wait_for(lambda: Job.objects.get(pk=job.pk).remote_pid, what="the PID to be recorded")
        assert pid_running(pid)
        assert Job.objects.get(pk=job.pk).request_cancel()
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        if thread.is_alive():
            Job.objects.filter(pk=job.pk).update(cancel_requested=True)
            thread.join(timeout=30)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert job.result == "Cancelled by an operator."
    assert not pid_running(pid)
    texts = [text for _, _, text in log_of(job)]
    assert "Cancel requested by an operator." in texts
    assert any(text.startswith(f"Ending process {pid}") for text in texts)


def test_cancelling_a_queued_job_ends_it_before_it_starts(local_node, channel_layer):
    job = make_command_job(local_node, ["true"])
    assert job.request_cancel()
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert not JobLogLine.objects.filter(job=job).exists()


def test_cancelling_a_running_job_asks_its_runner_and_leaves_its_state(local_node):
    job = make_command_job(local_node, ["sleep", "300"])
    assert job.mark_running("w1")
    assert Job.objects.get(pk=job.pk).request_cancel()
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.cancel_requested and job.finished_at is None


def test_a_job_claimed_by_its_runner_during_cancel_is_never_marked_cancelled_while_running(
    local_node, monkeypatch
):
    """The runner claims the job right after the canceller looked at it; the job must not end up
    cancelled while its process runs (the old check-then-finish did exactly that)."""
    job = make_command_job(local_node, ["sleep", "300"])
    original_finish = Job.finish

    def runner_claims_first(self, state, **kwargs):
        Job.objects.get(pk=self.pk).mark_running("w1")
        return original_finish(self, state, **kwargs)

    monkeypatch.setattr(Job, "finish", runner_claims_first)
    canceller = Job.objects.get(pk=job.pk)
    assert canceller.request_cancel()
    job.refresh_from_db()
    # One conditional UPDATE: the queued job is cancelled before any runner could start it.
    assert job.state == JobState.CANCELLED and job.started_at is None and job.worker == ""
    assert canceller.state == JobState.CANCELLED and canceller.finished_at == job.finished_at
    assert not job.mark_running("w2")  # A later claim finds nothing to run.


def test_a_command_past_its_timeout_fails_and_is_ended(local_node, channel_layer):
    job = python_job(local_node, "import time; print('working', flush=True); time.sleep(300)", timeout=1)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "longer than 1 s" in job.result


def test_nul_bytes_and_invalid_utf8_are_stored_readably(local_node, channel_layer):
    code = (
        "import sys\n"
        "sys.stdout.buffer.write(b'before\\x00after\\n\\xff\\xfe broken \\xc3\\n')\n"
        "sys.stdout.buffer.write(b'caf\\xc3\\xa9 \\x1b[31mred\\x1b[0m\\n')\n"
    )
    job = python_job(local_node, code)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert out_lines(job) == ["beforeafter", "\ufffd\ufffd broken \ufffd", "café \x1b[31mred\x1b[0m"]
    # Stored as it came (a download may want it), shown without the colour codes.
    assert (
        broadcast.log_line_html(7, "out", "café \x1b[31mred\x1b[0m")
        == '<div class="out" data-seq="7">café red</div>'
    )


def test_two_hundred_thousand_lines_are_all_stored_in_order_with_gap_free_seq(local_node, channel_layer):
    job = python_job(local_node, "import sys\nsys.stdout.writelines(f'{i}\\n' for i in range(200_000))")
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    seqs = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", flat=True).iterator())
    assert seqs == list(range(len(seqs)))
    assert job.next_seq == len(seqs)
    texts = list(
        JobLogLine.objects.filter(job=job, stream="out")
        .order_by("seq")
        .values_list("text", flat=True)
        .iterator()
    )
    assert texts == [str(i) for i in range(200_000)]


def test_enqueue_sends_the_task_only_after_the_transaction_commits(local_node, monkeypatch):
    from django.db import transaction

    sent = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: sent.append(job.pk))
    with transaction.atomic():
        job = make_command_job(local_node, ["true"])
        job.enqueue()
        assert sent == []
    assert sent == [job.pk]


def test_a_log_past_the_cap_keeps_its_head_and_tail_and_marks_the_cut(
    local_node, channel_layer, settings, monkeypatch
):
    settings.RAMDECK_JOB_LOG_MAX_LINES = 1000
    monkeypatch.setattr(logwriter, "TRIM_SLACK", 100)
    job = python_job(local_node, "for i in range(6000): print('line', i)")
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    rows = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", "text"))
    assert len(rows) == 1001  # 500 first, the marker, 500 last
    assert [seq for seq, _ in rows[:501]] == list(range(501))
    assert rows[500][1].startswith(f"[… {job.next_seq - 1000} lines cut here")
    assert rows[-1] == (job.next_seq - 1, f"Succeeded: {job.result}")
    assert rows[1][1] == "line 0" and rows[-2][1] == "line 5999"


def test_a_posix_command_met_by_a_windows_node_fails_the_job_with_its_reason_not_a_traceback():
    from jobs.runner import _outcome_of_exception
    from remote.powershell import NotForWindows

    exc = NotForWindows("'sh' would reach Windows with an argument it changes")
    state, code, result, lines = _outcome_of_exception(exc, None)
    assert (state, code, lines) == (JobState.FAILED, None, [])
    assert (
        result
        == "This does not run on a Windows node yet: 'sh' would reach Windows with an argument it changes"
    )
