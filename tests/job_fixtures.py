"""Fixtures and helpers shared by the job engine's tests (runner, consumers, views, sweeper).

A pytest plugin (registered in tests/conftest.py): its fixtures are every test's; its helpers are imported.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from channels.layers import get_channel_layer

from jobs.broadcast import call_sync
from jobs.models import Job, JobLogLine
from nodes.models import Transport
from tests.factories import NodeFactory

PYTHON = sys.executable


@pytest.fixture
def channel_layer(settings):
    """The real Redis channel layer, under a prefix of this test's own: concurrent test runs (whose job
    ids start at 1 too) never hear each other's groups."""
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [settings.REDIS_URL],
                "prefix": f"t{uuid.uuid4().hex[:12]}",
                "expiry": 60,
                # Tests read a channel only after the job ended: room for every batch of a long log.
                "capacity": 100_000,
            },
        }
    }
    return get_channel_layer()


@pytest.fixture
def job_kind():
    """Register a job kind for this test only (`job_kind(name, body, **options)`); a kind registered
    before is put back afterwards."""
    from jobs import kinds

    replaced: dict[str, kinds.Kind | None] = {}

    def register(name: str, body, **options):
        replaced.setdefault(name, kinds.get(name))
        label = kinds.get(name).label if kinds.get(name) else name.replace("-", " ").capitalize()
        return kinds.register(name, label, body, **options)

    yield register
    for name, previous in replaced.items():
        kinds.unregister(name)
        if previous is not None:
            kinds.register(**dataclasses.asdict(previous))


@pytest.fixture
def local_node(transactional_db):
    return NodeFactory(name="console-host", address="127.0.0.1", transport=Transport.LOCAL)


def make_command_job(node, argv: list[str], **params) -> Job:
    return Job.objects.create(
        kind="command", node=node, title=" ".join(argv)[:200], params={"argv": argv, **params}
    )


def python_job(node, code: str, **params) -> Job:
    return make_command_job(node, [PYTHON, "-c", code], **params)


def database_url() -> str:
    """A DATABASE_URL for a subprocess (a Celery worker) that must see this test's database."""
    from urllib.parse import quote

    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = quote(db["USER"] or "") + (f":{quote(db['PASSWORD'])}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or 'localhost'}:{db['PORT'] or 5432}/{db['NAME']}"


class CeleryWorker:
    """A real Celery worker process on the test database, consuming a work queue and a control queue of
    this test's own (both, like `make run`'s two workers together).

    With `default_queue=True` they become the console's queues before the test starts anything else, so
    the jobs and tasks a live server forked afterwards sends land here too.
    """

    def __init__(
        self,
        tmp_path: Path,
        name: str | None = None,
        *,
        default_queue: bool = False,
        queue: str | None = None,
        consume: tuple[str, ...] = ("work", "control"),
    ) -> None:
        # `queue`: share another worker's queues (a second worker, or one that takes over after a crash).
        self.queue = queue or f"ramdeck-test-{uuid.uuid4().hex[:10]}"
        self.control_queue = f"{self.queue}-control"
        self.consume = consume
        self._saved_control_queue = None
        self.name = name or f"{self.queue}-{'-'.join(consume)}@{socket.gethostname()}"
        self.log_path = tmp_path / f"{self.name.split('@')[0]}.log"
        self.default_queue = default_queue
        self.process: subprocess.Popen | None = None

    def start(self) -> CeleryWorker:

        if self.default_queue and self._saved_control_queue is None:
            self.route_here()
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "PYTHONUNBUFFERED": "1",
            "RAMDECK_WORK_QUEUE": self.queue,
            "RAMDECK_CONTROL_QUEUE": self.control_queue,
        }
        celery = str(Path(PYTHON).with_name("celery"))
        queues = ",".join(self.queue if kind == "work" else self.control_queue for kind in self.consume)
        argv = [celery, "-A", "ramdeck_site", "worker", "-P", "solo", "-Q", queues, "-n", self.name]
        argv += ["--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for(
            lambda: " ready." in self.log() or self.process.poll() is not None, timeout=60, what="worker"
        )
        assert self.process.poll() is None, self.log()
        return self

    def route_here(self) -> None:
        """Make this worker's queues the console's (before it starts, if the test wants messages waiting)."""
        from django.conf import settings

        from ramdeck_site.celery import app

        self.default_queue = True
        app.conf.task_default_queue = self.queue
        self._saved_control_queue = settings.RAMDECK_CONTROL_QUEUE
        settings.RAMDECK_CONTROL_QUEUE = self.control_queue

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send(self, job_id: int, task_id: str | None = None) -> None:
        from jobs import tasks

        tasks.run_job.apply_async(args=[job_id], queue=self.queue, task_id=task_id)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.default_queue:
            from django.conf import settings

            from ramdeck_site.celery import app

            app.conf.task_default_queue = settings.CELERY_TASK_DEFAULT_QUEUE
            settings.RAMDECK_CONTROL_QUEUE = self._saved_control_queue
        self._forget_queue()

    def _forget_queue(self) -> None:
        """Leave nothing of this test in the broker (a killed worker's unacknowledged message included)."""
        import redis
        from django.conf import settings

        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        client.delete(self.queue, self.control_queue)
        for tag, payload in client.hgetall("unacked").items():
            if self.queue.encode() in payload:
                client.hdel("unacked", tag)
                client.zrem("unacked_index", tag)


def log_of(job: Job) -> list[tuple[int, str, str]]:
    return list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", "stream", "text"))


def wait_for(
    condition: Callable[[], object], *, timeout: float = 30.0, interval: float = 0.05, what: str = ""
):
    """Poll until `condition()` is truthy; fail the test after `timeout` seconds (a hang guard, not a
    performance assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"Timed out after {timeout:g} s waiting for {what or condition}.")


def pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def receive_all(layer, channel: str, *, quiet: float = 1.0) -> list[dict]:
    """Every message waiting on a channel (until none arrives for `quiet` seconds)."""
    import asyncio

    async def drain() -> list[dict]:
        messages = []
        while True:
            try:
                messages.append(await asyncio.wait_for(layer.receive(channel), quiet))
            except TimeoutError:
                return messages

    return call_sync(drain)
