"""Control work never waits behind long work: the two Celery workers exactly as `make run` starts them (the
console command's own Procfile lines), on queues of this test's own, against the real Redis broker."""

from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest

from jobs.models import Job, JobState
from nodes.probe.job import start_probe
from ramdeck_site.management.commands.console import console_processes
from tests.job_fixtures import database_url, log_of, python_job, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


class ProcfileWorkers:
    """The `worker` and `control` lines of the console's Procfile, started for real."""

    def __init__(self, tmp_path: Path, settings) -> None:
        from ramdeck_site.celery import app

        tag = uuid.uuid4().hex[:8]
        self.work_queue, self.control_queue = f"ramdeck-test-{tag}", f"ramdeck-test-{tag}-control"
        self.saved = (app.conf.task_default_queue, settings.RAMDECK_CONTROL_QUEUE)
        settings.CELERY_TASK_DEFAULT_QUEUE = app.conf.task_default_queue = self.work_queue
        settings.RAMDECK_CONTROL_QUEUE = self.control_queue
        self.settings, self.tmp_path, self.tag = settings, tmp_path, tag
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self) -> ProcfileWorkers:
        lines = dict(line.split(": ", 1) for line in console_processes("127.0.0.1", 0, concurrency=1))
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "RAMDECK_WORK_QUEUE": self.work_queue,
            "RAMDECK_CONTROL_QUEUE": self.control_queue,
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("worker", "control"):
            # A name of this test's own, so no other worker on this machine answers for it.
            argv = [arg.replace("@%h", f"-{self.tag}@%h") for arg in shlex.split(lines[name])]
            log = (self.tmp_path / f"{name}.log").open("wb")
            self.processes[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        for name in self.processes:
            wait_for(lambda name=name: " ready." in self.log(name), timeout=90, what=f"the {name} worker")
        return self

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        import redis

        from ramdeck_site.celery import app

        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        app.conf.task_default_queue, self.settings.RAMDECK_CONTROL_QUEUE = self.saved
        redis.Redis.from_url(self.settings.CELERY_BROKER_URL).delete(self.work_queue, self.control_queue)


@pytest.fixture
def procfile_workers(tmp_path, settings):
    workers = ProcfileWorkers(tmp_path, settings)
    yield workers.start()
    workers.stop()


def test_the_procfile_starts_a_work_worker_and_a_control_worker_on_their_queues(settings):
    lines = dict(line.split(": ", 1) for line in console_processes("127.0.0.1", 8000, concurrency=4))
    assert {"web", "worker", "control", "beat"} <= set(lines)
    assert f"-Q {settings.CELERY_TASK_DEFAULT_QUEUE} " in lines["worker"] and "-c 4" in lines["worker"]
    assert f"-Q {settings.RAMDECK_CONTROL_QUEUE} " in lines["control"]


def test_a_probe_runs_while_the_work_worker_is_busy_with_a_long_job(local_node, procfile_workers):
    long_job = python_job(local_node, "import time\nprint('busy', flush=True)\ntime.sleep(300)")
    long_job.enqueue()
    wait_for(lambda: any(t == "busy" for _, _, t in log_of(long_job)), timeout=60, what="the long job")

    probe = start_probe(local_node)
    probe = wait_for(
        lambda: Job.objects.filter(pk=probe.pk, state__in=[JobState.SUCCEEDED, JobState.FAILED]).first(),
        timeout=90,
        what="the probe to end while the long job runs",
    )
    long_job.refresh_from_db()
    assert probe.state == JobState.SUCCEEDED, probe.result
    assert long_job.state == JobState.RUNNING
    assert probe.worker.startswith("control-") and long_job.worker.startswith("work-")

    long_job.request_cancel()
    wait_for(lambda: Job.objects.get(pk=long_job.pk).state == JobState.CANCELLED, timeout=60, what="cancel")
