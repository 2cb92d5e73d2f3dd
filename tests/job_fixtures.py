"""Fixtures and helpers shared by the job engine's tests (runner, consumers, views, sweeper).

Import the fixtures by name in a test module (`from tests.job_fixtures import local_node, ...`).
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable

import psutil
import pytest
from channels.layers import get_channel_layer

from jobs.broadcast import call_sync
from jobs.models import Job, JobKind, JobLogLine
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
def local_node(transactional_db):
    return NodeFactory(name="console-host", address="127.0.0.1", transport=Transport.LOCAL)


def make_command_job(node, argv: list[str], **params) -> Job:
    return Job.objects.create(
        kind=JobKind.COMMAND, node=node, title=" ".join(argv)[:200], params={"argv": argv, **params}
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
