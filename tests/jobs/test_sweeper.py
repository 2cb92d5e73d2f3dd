"""Lost jobs, with a real Celery worker process on the (file-based) test database and the real Redis broker.

Each test's worker consumes a queue of its own, so other workers on this machine never take its tasks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from jobs import runner, sweeper, tasks
from jobs.models import Job, JobState
from nodes import tasks as node_tasks
from tests.job_fixtures import CeleryWorker, log_of, pid_running, python_job, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker_factory(tmp_path):
    started: list[CeleryWorker] = []

    def start(name: str | None = None) -> CeleryWorker:
        worker = CeleryWorker(tmp_path, name)
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def orphans():
    """PIDs a test expects to be ended; killed at teardown whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if pid_running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_job_whose_worker_was_killed_becomes_errored_and_its_process_is_ended(
    local_node, worker_factory, orphans
):
    job = python_job(local_node, "import time\nprint('started', flush=True)\ntime.sleep(600)")
    worker = worker_factory()
    worker.send(job.pk)
    wait_for(lambda: any(t == "started" for _, _, t in log_of(job)), what="the job to start in the worker")
    pid = wait_for(lambda: Job.objects.get(pk=job.pk).remote_pid, what="the remote PID")
    orphans.append(pid)
    assert Job.objects.get(pk=job.pk).worker == worker.name

    worker.kill()
    assert pid_running(pid)  # The command outlived its worker: exactly what the sweeper must clean up.
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING

    lost = sweeper.sweep(stale_after=0)

    job.refresh_from_db()
    assert lost == [job.pk]
    assert job.state == JobState.ERRORED
    assert job.result.startswith(f"Worker lost: worker {worker.name} stopped answering")
    assert not pid_running(pid)
    texts = [text for _, _, text in log_of(job)]
    assert f"Ended process {pid} on {local_node.name}." in texts


def test_a_duplicated_task_message_runs_the_job_once(local_node, worker_factory, tmp_path):
    marker = tmp_path / "runs"
    job = python_job(local_node, f"open({str(marker)!r}, 'a').write('ran\\n'); print('done')")
    worker = worker_factory()
    task_id = str(uuid.uuid4())
    worker.send(job.pk, task_id)
    worker.send(job.pk, task_id)  # The broker delivers the same message twice.
    wait_for(lambda: worker.log().count(f"[{task_id}] succeeded") == 2, timeout=120, what="both deliveries")
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert marker.read_text() == "ran\n"
    assert [text for _, stream, text in log_of(job) if stream == "out"] == ["done"]


def test_a_restarted_worker_declares_its_previous_jobs_lost(local_node, worker_factory, orphans, tmp_path):
    name = f"ramdeck-test-{uuid.uuid4().hex[:10]}@{socket.gethostname()}"
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    orphans.append(sleeper.pid)
    job = python_job(local_node, "print('never runs again')")
    job.mark_running(worker=name)
    Job.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    job.record_remote_pid(sleeper.pid)

    worker_factory(name)  # The same hostname comes back: whatever ran the job is gone.

    job.refresh_from_db()
    assert job.state == JobState.ERRORED
    assert job.result == f"Worker lost: {name} restarted while the job was running."
    assert sleeper.wait(timeout=30) is not None
    assert not pid_running(sleeper.pid)


def test_a_live_worker_with_a_fresh_heartbeat_is_not_swept(local_node):
    job = python_job(local_node, "print(1)")
    job.mark_running(worker="busy@somewhere")
    assert sweeper.sweep(alive=set()) == []  # Heartbeat is fresh: not a suspect, whatever the ping says.
    Job.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(minutes=2))
    assert sweeper.sweep(alive={"busy@somewhere"}) == []  # Stale, but its worker answers: wait.
    assert sweeper.sweep(alive=set()) == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.ERRORED


def test_a_lost_rpc_server_step_keeps_its_daemon_running_as_adopted(local_node, orphans):
    daemon = subprocess.Popen(["sleep", "600"], start_new_session=True)
    orphans.append(daemon.pid)
    job = Job.objects.create(kind="rpc_server", node=local_node)
    job.mark_running(worker="gone@nowhere")
    job.record_remote_pid(daemon.pid)
    assert sweeper.sweep(stale_after=0, alive=set()) == [job.pk]
    assert pid_running(daemon.pid)
    texts = [text for _, _, text in log_of(job)]
    assert any("adopted" in text for text in texts)


def test_the_beat_schedule_names_the_sweep_task_that_exists():
    from ramdeck_site.celery import app

    app.loader.import_default_modules()
    assert app.conf.beat_schedule["sweep-lost-jobs"]["task"] == "jobs.tasks.sweep_lost_jobs"
    assert "jobs.tasks.sweep_lost_jobs" in app.tasks and "jobs.tasks.run_job" in app.tasks


def test_a_job_past_the_soft_time_limit_is_errored_and_its_process_ended(local_node, monkeypatch, orphans):
    from celery.exceptions import SoftTimeLimitExceeded

    from jobs import runner

    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    orphans.append(sleeper.pid)
    job = python_job(local_node, "print(1)")

    def overrun(job_id: int, *, worker: str = "") -> None:
        claimed = Job.objects.get(pk=job_id)
        claimed.mark_running(worker)
        claimed.record_remote_pid(sleeper.pid)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(runner, "run_job", overrun)
    tasks.run_job.apply(args=[job.pk])
    job.refresh_from_db()
    assert job.state == JobState.ERRORED
    assert job.result == "The job ran past the time limit for jobs and was stopped."
    assert sleeper.wait(timeout=30) is not None


def test_a_reused_pid_is_never_ended_by_the_sweeper(local_node, orphans):
    """The job's process ended long ago and its PID now belongs to a newer program: left alone."""
    newcomer = subprocess.Popen(["sleep", "600"], start_new_session=True)
    orphans.append(newcomer.pid)
    job = python_job(local_node, "print(1)")
    job.mark_running(worker="gone@nowhere")
    job.record_remote_pid(newcomer.pid)
    # The job's last sign of life was ten minutes ago; the process on that PID is a second old.
    Job.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(minutes=10))
    assert sweeper.sweep(stale_after=0, alive=set()) == [job.pk]
    assert pid_running(newcomer.pid)
    texts = [text for _, _, text in log_of(job)]
    assert any("had already exited" in text for text in texts)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:05", 5), ("  12:34\n", 754), ("01:02:03", 3723), ("2-03:04:05", 183845), ("", None), ("x", None)],
)
def test_ps_elapsed_time_is_read_in_both_formats(text, seconds):
    assert sweeper.parse_etime(text) == seconds


# -- queued jobs whose message was lost -----------------------------------------------------------------


@pytest.fixture
def private_queues(settings):
    """Queues of this test's own on the real broker, emptied afterwards."""
    from ramdeck_site.celery import app

    tag = uuid.uuid4().hex[:8]
    saved = (app.conf.task_default_queue, settings.RAMDECK_CONTROL_QUEUE)
    app.conf.task_default_queue = f"ramdeck-test-{tag}"
    settings.RAMDECK_CONTROL_QUEUE = f"ramdeck-test-{tag}-control"
    yield app.conf.task_default_queue, settings.RAMDECK_CONTROL_QUEUE
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(
        app.conf.task_default_queue, settings.RAMDECK_CONTROL_QUEUE
    )
    app.conf.task_default_queue, settings.RAMDECK_CONTROL_QUEUE = saved


def _queued_long_ago(job: Job, *, minutes: int) -> None:
    then = timezone.now() - timedelta(minutes=minutes)
    Job.objects.filter(pk=job.pk).update(created_at=then, enqueued_at=then)


def test_a_queued_job_whose_message_was_lost_is_sent_again(local_node, private_queues):
    job = python_job(local_node, "print(1)")
    assert job.send_to_worker()
    assert job.pk in sweeper.job_ids_in_broker()
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(*private_queues)  # Redis lost its queues.
    assert job.pk not in sweeper.job_ids_in_broker()
    _queued_long_ago(job, minutes=5)

    assert sweeper.sweep_queued() == ([job.pk], [])

    assert job.pk in sweeper.job_ids_in_broker()
    job.refresh_from_db()
    assert job.state == JobState.QUEUED and job.enqueue_count == 2


def test_a_queued_job_whose_message_still_waits_is_left_alone(local_node, private_queues):
    job = python_job(local_node, "print(1)")
    assert job.send_to_worker()
    _queued_long_ago(job, minutes=5)
    assert sweeper.sweep_queued() == ([], [])
    job.refresh_from_db()
    assert job.enqueue_count == 1


def test_a_job_queued_for_too_long_is_errored_as_never_started(local_node, private_queues, settings):
    settings.RAMDECK_QUEUED_GIVE_UP_S = 600
    job = python_job(local_node, "print(1)")
    _queued_long_ago(job, minutes=11)
    assert sweeper.sweep_queued() == ([], [job.pk])
    job.refresh_from_db()
    assert job.state == JobState.ERRORED and job.result.startswith("Never started")


def test_a_lost_probe_message_does_not_stop_the_probe_schedule(local_node, private_queues):
    first = node_tasks.probe_all_nodes()
    assert len(first) == 1
    assert node_tasks.probe_all_nodes() == []  # One probe per node at a time...
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(*private_queues)  # ...but its message is lost.
    _queued_long_ago(Job.objects.get(pk=first[0]), minutes=5)
    assert sweeper.sweep_queued() == (first, [])
    assert runner.run_job(first[0])  # The message sent again is taken and the probe runs.
    assert Job.objects.get(pk=first[0]).state == JobState.SUCCEEDED
    assert len(node_tasks.probe_all_nodes()) == 1  # and the schedule goes on.
