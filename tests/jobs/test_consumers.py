"""Websocket consumers through the real ASGI stack (session auth, origin check) and the real Redis layer."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from jobs import broadcast, runner
from jobs.models import Job, JobState
from ramdeck_site.asgi import application
from tests.factories import UserFactory
from tests.job_fixtures import log_of, make_command_job, python_job
from tests.sockets import connect, session_cookie, viewer, watcher

pytestmark = pytest.mark.django_db(transaction=True)


SEQ = re.compile(r'data-seq="(\d+)"')
TIMEOUT = 15


async def receive_until_closed(communicator: WebsocketCommunicator) -> list[str]:
    messages = []
    while True:
        event = await communicator.receive_output(timeout=TIMEOUT)
        if event["type"] == "websocket.close":
            return messages
        messages.append(event["text"])


async def receive_seqs(communicator: WebsocketCommunicator, count: int) -> list[int]:
    """Collect line seqs from messages until `count` lines arrived (status messages carry none)."""
    seqs: list[int] = []
    while len(seqs) < count:
        seqs += [int(s) for s in SEQ.findall(await communicator.receive_from(timeout=TIMEOUT))]
    return seqs


@database_sync_to_async
def running_job_with_lines(node, count: int) -> Job:
    job = make_command_job(node, ["true"])
    job.mark_running("w1")
    job.append_lines([("out", f"line {i}") for i in range(count)])
    return job


async def save_then_send(job: Job, texts: list[str]) -> list:
    rows = await database_sync_to_async(job.append_lines)([("out", t) for t in texts])
    await broadcast.send_lines(job.pk, rows)
    return rows


async def test_a_watcher_gets_the_backlog_then_live_lines_of_a_real_job_each_once(
    local_node, channel_layer, tmp_path
):
    user = await watcher()
    go = tmp_path / "go"
    code = (
        "import os, time\n"
        "for i in range(3): print('early', i, flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
        "for i in range(3): print('late', i, flush=True)\n"
    )
    job = await database_sync_to_async(python_job)(local_node, code)
    thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
    thread.start()
    try:
        await _wait_for_lines(job, 4)  # "$ python ..." and three early lines are saved.
        communicator, connected, _ = await connect(f"/ws/jobs/{job.pk}/?after=-1", user)
        assert connected
        first = await communicator.receive_from(timeout=TIMEOUT)
        assert first.startswith(f'<div hx-swap-oob="beforeend:#job-log-{job.pk}">')
        assert "early 2" in first
        go.touch()
        messages = [first, *await receive_until_closed(communicator)]
    finally:
        go.touch()
        await asyncio.to_thread(thread.join, 60)
    seqs = [int(s) for m in messages for s in SEQ.findall(m)]
    stored = await database_sync_to_async(log_of)(job)
    assert seqs == [seq for seq, _, _ in stored]  # Every line, once, in order: no gap, no repeat.
    assert "late 2" in "".join(messages)
    summaries = [m for m in messages if f'id="job-summary-{job.pk}"' in m]
    assert 'class="badge succeeded"' in summaries[-1] and 'hx-swap-oob="outerHTML"' in summaries[-1]


async def _wait_for_lines(job: Job, count: int) -> None:
    for _ in range(600):
        if len(await database_sync_to_async(log_of)(job)) >= count:
            return
        await asyncio.sleep(0.05)
    pytest.fail("the job never wrote its first lines")


async def test_a_reconnect_with_after_resumes_without_gaps_or_repeats(local_node, channel_layer):
    user = await watcher()
    job = await running_job_with_lines(local_node, 10)
    communicator, connected, _ = await connect(f"/ws/jobs/{job.pk}/?after=4", user)
    assert connected
    assert await receive_seqs(communicator, 5) == [5, 6, 7, 8, 9]
    await save_then_send(job, ["line 10", "line 11", "line 12"])
    # A message that repeats lines already sent (as after a backlog race) adds only what is new.
    overlap = await database_sync_to_async(lambda: list(job.log_lines.filter(seq__gte=8).order_by("seq")))()
    await broadcast.send_lines(job.pk, overlap)
    await save_then_send(job, ["line 13"])
    assert await receive_seqs(communicator, 4) == [10, 11, 12, 13]
    assert await communicator.receive_nothing(timeout=0.5)
    await communicator.disconnect()


async def test_a_lost_group_message_is_filled_in_from_the_database(local_node, channel_layer):
    user = await watcher()
    job = await running_job_with_lines(local_node, 3)
    communicator, connected, _ = await connect(f"/ws/jobs/{job.pk}/?after=2", user)
    assert connected
    await communicator.receive_from(timeout=TIMEOUT)  # The status summary.
    await database_sync_to_async(job.append_lines)([("out", "saved but never sent")])
    await save_then_send(job, ["line 4"])
    messages = [
        await communicator.receive_from(timeout=TIMEOUT),
        await communicator.receive_from(timeout=TIMEOUT),
    ]
    assert [int(s) for m in messages for s in SEQ.findall(m)] == [3, 4]
    assert "saved but never sent" in messages[0]
    await communicator.disconnect()


async def test_a_finished_job_sends_its_log_and_summary_then_closes(local_node, channel_layer):
    user = await watcher()
    job = await running_job_with_lines(local_node, 2)
    await database_sync_to_async(job.finish)(
        JobState.FAILED, exit_code=2, result="make exited with status 2."
    )
    communicator, connected, _ = await connect(f"/ws/jobs/{job.pk}/", user)
    assert connected
    messages = await receive_until_closed(communicator)
    assert [int(s) for s in SEQ.findall(messages[0])] == [0, 1]
    assert "make exited with status 2." in messages[1] and 'class="badge failed"' in messages[1]


async def test_anonymous_visitors_are_refused(local_node, channel_layer):
    job = await running_job_with_lines(local_node, 1)
    for path in (f"/ws/jobs/{job.pk}/", "/ws/jobs/"):
        communicator, connected, code = await connect(path)
        assert not connected
        await communicator.disconnect()


async def test_users_without_a_role_are_refused(local_node, channel_layer):
    stranger = await database_sync_to_async(UserFactory)(username="sam-stranger")
    job = await running_job_with_lines(local_node, 1)
    for path in (f"/ws/jobs/{job.pk}/", "/ws/jobs/"):
        communicator, connected, code = await connect(path, stranger)
        assert not connected and code == 4403
        await communicator.disconnect()


async def test_a_missing_job_is_refused(channel_layer):
    user = await viewer()
    communicator, connected, _ = await connect("/ws/jobs/999999/", user)
    assert not connected
    await communicator.disconnect()


async def test_another_site_cannot_open_the_socket(local_node, channel_layer):
    user = await watcher()
    job = await running_job_with_lines(local_node, 1)
    cookie = await database_sync_to_async(session_cookie)(user)
    headers = [(b"origin", b"http://evil.example"), (b"cookie", f"sessionid={cookie}".encode())]
    communicator = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=headers)
    connected, _ = await communicator.connect(timeout=TIMEOUT)
    assert not connected
    await communicator.disconnect()


async def test_the_job_list_socket_sends_badges_as_states_change(local_node, channel_layer):
    user = await viewer()
    job = await database_sync_to_async(make_command_job)(local_node, ["true"])
    communicator, connected, _ = await connect("/ws/jobs/", user)
    assert connected
    await database_sync_to_async(job.mark_running)("w1")
    await broadcast.send_status(job.pk, job.state)
    badge = await communicator.receive_from(timeout=TIMEOUT)
    assert (
        badge == f'<span id="job-badge-{job.pk}" class="badge running" hx-swap-oob="outerHTML">Running</span>'
    )
    await database_sync_to_async(job.finish)(JobState.SUCCEEDED)
    await broadcast.send_status(job.pk, job.state)
    assert "badge succeeded" in await communicator.receive_from(timeout=TIMEOUT)
    await communicator.disconnect()


@pytest.mark.security
async def test_markup_arriving_through_the_channel_layer_is_never_forwarded(local_node, channel_layer):
    """Anyone who can write to the channel layer (a shared Redis) can put anything in a group message: the
    consumer renders lines itself from (seq, stream, text), so markup in it reaches the page as text."""
    user = await watcher()
    job = await running_job_with_lines(local_node, 1)
    communicator, connected, _ = await connect(f"/ws/jobs/{job.pk}/?after=0", user)
    assert connected
    await communicator.receive_from(timeout=TIMEOUT)  # The status summary.
    hostile = {
        "type": "job.lines",
        "job_id": job.pk,
        "first": 1,
        "lines": [
            ["out", "<script>alert(1)</script>"],
            ['err" onmouseover="alert(2)', "a stream that is not one"],
            '<img src=x onerror="alert(3)">',  # the old message format: markup, taken as text
        ],
    }
    await channel_layer.group_send(broadcast.group_name(job.pk), hostile)
    sent = await communicator.receive_from(timeout=TIMEOUT)
    assert "<script>" not in sent and "<img" not in sent and "onmouseover" not in sent
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in sent
    assert '<div class="out" data-seq="2">a stream that is not one</div>' in sent
    assert "&lt;img src=x onerror=&quot;alert(3)&quot;&gt;" in sent
    assert SEQ.findall(sent) == ["1", "2", "3"]
    await channel_layer.group_send(
        broadcast.group_name(job.pk), {"type": "job.lines", "first": "<b>", "lines": []}
    )
    assert await communicator.receive_nothing(timeout=0.5)
    await communicator.disconnect()
