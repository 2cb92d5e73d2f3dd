"""Faults of what the console stands on, injected mid-operation with real processes: a task message lost,
Redis restarted during a log stream (a private redis-server this test starts: never the system one), a full
disk during a build (a small tmpfs of this test's own)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import threading
import uuid

import pytest
import redis
from channels.db import database_sync_to_async
from django.conf import settings

from jobs import runner, sweeper
from jobs.models import Job, JobLogLine, JobState
from nodes import tasks as node_tasks
from ramdeck_site import services
from tests.deploy_fixtures import lab_node, log_text, run
from tests.job_fixtures import CeleryWorker, python_job, wait_for
from tests.llamacpp_build import TARBALL, use_cached_llamacpp
from tests.sockets import connect, watcher

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]

SEQ = re.compile(r'data-seq="(\d+)"')


@pytest.mark.lab
def test_a_lost_probe_message_is_sent_again_and_the_probe_schedule_goes_on(lab, lab_host, tmp_path):
    node = lab_node(lab, lab_host)
    worker = CeleryWorker(tmp_path, consume=("control",))
    worker.route_here()  # the console sends here; the worker starts only after the message is lost
    try:
        (first,) = node_tasks.probe_all_nodes()
        redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(worker.control_queue)  # Redis lost it
        worker.start()
        assert node_tasks.probe_all_nodes() == []  # one probe per node at a time: the schedule is stuck...
        assert Job.objects.get(pk=first).state == JobState.QUEUED

        assert sweeper.sweep_queued(resend_after=0) == ([first], [])  # ...until the sweeper sends it again

        wait_for(lambda: Job.objects.get(pk=first).state == JobState.SUCCEEDED, timeout=120, what="the probe")
        (second,) = node_tasks.probe_all_nodes()
        wait_for(
            lambda: Job.objects.get(pk=second).state == JobState.SUCCEEDED, timeout=120, what="next probe"
        )
        node.refresh_from_db()
        assert node.last_probe_at is not None
    finally:
        worker.stop()


class PrivateRedis:
    """A redis-server of this test's own on a free port, which the test may restart."""

    def __init__(self, tmp_path) -> None:
        self.port = services.free_port()
        self.workdir = tmp_path
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            services.redis_command(self.port, str(self.workdir)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: services.redis_answers(self.url, timeout=0.2), timeout=10, what="redis-server")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def private_redis(tmp_path, settings):
    server = PrivateRedis(tmp_path)
    server.start()
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [server.url], "prefix": f"t{uuid.uuid4().hex[:8]}", "capacity": 100_000},
        }
    }
    yield server
    server.stop()


async def _seqs_until_closed_or_broken(communicator, seen: list[int], enough: asyncio.Event) -> str:
    """Read line seqs until the socket closes (the job ended) or breaks (Redis went away)."""
    while True:
        try:
            event = await communicator.receive_output(timeout=20)
        except Exception as exc:
            return f"broken: {type(exc).__name__}"
        if event["type"] == "websocket.close":
            return "closed"
        seen.extend(int(s) for s in SEQ.findall(event.get("text", "")))
        if len(seen) >= 100:
            enough.set()


async def test_redis_restarted_during_a_log_stream_loses_no_line(local_node, private_redis):
    job = await database_sync_to_async(python_job)(
        local_node,
        "import time\nfor i in range(800):\n    print('line', i, flush=True)\n    time.sleep(0.01)",
    )
    user = await watcher()
    thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
    first, connected, _ = await connect(f"/ws/jobs/{job.pk}/", user)
    assert connected
    thread.start()
    seen_first: list[int] = []
    enough = asyncio.Event()
    reader = asyncio.create_task(_seqs_until_closed_or_broken(first, seen_first, enough))
    await asyncio.wait_for(enough.wait(), 60)

    await asyncio.to_thread(private_redis.restart)  # mid-stream: every group and message in Redis is gone

    outcome = await asyncio.wait_for(reader, 60)
    with contextlib.suppress(Exception):  # the consumer whose layer died ended with that error
        await first.disconnect()
    # The page reconnects (htmx's ws extension does) and says where it was.
    last = max(seen_first)
    second, connected, _ = await connect(f"/ws/jobs/{job.pk}/?after={last}", user)
    assert connected
    seen_second: list[int] = []
    assert await _seqs_until_closed_or_broken(second, seen_second, asyncio.Event()) == "closed"
    await asyncio.to_thread(thread.join, 60)

    stored = await database_sync_to_async(
        lambda: list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("seq", flat=True))
    )()
    state = await database_sync_to_async(lambda: Job.objects.get(pk=job.pk).state)()
    assert state == JobState.SUCCEEDED
    assert stored == list(range(len(stored))) and len(stored) >= 802  # every line saved, no gap
    received = [s for s in seen_first if s <= last] + seen_second
    assert received == stored, f"first socket ended {outcome}"  # each line once, in order


@pytest.mark.lab
@pytest.mark.llamacpp
def test_a_full_disk_during_a_build_fails_naming_it(lab, lab_host, tmp_path, settings):
    use_cached_llamacpp(settings)  # builds upload the pinned source and find it compiled
    small = tmp_path / "small-disk"
    small.mkdir()
    # Mounted where the lab host's sshd (and so every command of the build) sees it: its mount namespace.
    in_host = ["nsenter", "--target", str(lab_host.sshd_pid), "--mount", "--"]
    subprocess.run([*in_host, "mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(small)], check=True)
    try:
        settings.RAMDECK_BUILD_ROOT = str(small)
        node = lab_node(lab, lab_host)
        job = run(
            Job.objects.create(kind="build", node=node, params={"source": "tarball", "tarball": str(TARBALL)})
        )
        print(f"\nFAULT full disk during a build: {job.get_state_display()}: {job.result}")
        assert job.state in (JobState.FAILED, JobState.ERRORED), job.result
        assert "disk is full" in job.result or "No space left on device" in job.result, job.result
        assert "No space left on device" in log_text(job)
        assert not node.builds.exists()
    finally:
        subprocess.run([*in_host, "umount", "-l", str(small)], check=False, timeout=30)
