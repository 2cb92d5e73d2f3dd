"""The deployment page over its websocket, through the real ASGI stack and the real Redis layer: state, steps
and their log lines arrive as the run goes, rendered from the page's own partials; polling is only the
fallback."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
from channels.db import database_sync_to_async
from django.urls import reverse

from deployments.lifecycle import actions as lifecycle
from deployments.lifecycle.actions import STEP_KINDS
from jobs import runner
from tests.sockets import connect, viewer

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 20
STATE = re.compile(r'id="deployment-state">([^<]+)<')


async def states_until(communicator, wanted: str) -> list[str]:
    """Every state the page was shown in, until `wanted`."""
    seen = []
    while True:
        html = await communicator.receive_from(timeout=TIMEOUT)
        assert 'hx-swap-oob="outerHTML"' in html
        communicator.last_html = html
        seen += STATE.findall(html)
        if seen and seen[-1] == wanted:
            return seen


@pytest.fixture
def chatty_steps(job_kind):
    async def body(ctx) -> str:
        await ctx.log(f"{ctx.job.kind} says hello")
        await asyncio.sleep(0.3)
        return "ok"

    for kind in set(STEP_KINDS.values()):
        job_kind(kind, body, needs_transport=False)


async def test_the_page_follows_the_run_live(deployment, no_enqueue, chatty_steps, channel_layer):
    user = await viewer()
    communicator, connected, _ = await connect(f"/ws/deployments/{deployment.pk}/", user)
    assert connected
    assert await states_until(communicator, "Confirmed") == ["Confirmed"]

    ok, _ = await database_sync_to_async(lifecycle.start_deploy)(deployment, deployment.created_by)
    assert ok
    assert (await states_until(communicator, "Preparing"))[-1] == "Preparing"
    run = await database_sync_to_async(lambda: lifecycle.runs_of(deployment, lifecycle.DEPLOY).get())()
    thread = threading.Thread(target=runner.run_job, args=(run.pk,), daemon=True)
    thread.start()
    seen = await states_until(communicator, "Running")
    assert "Launching" in seen or "Verifying" in seen
    await asyncio.to_thread(thread.join, 30)
    html = communicator.last_html
    while "measure says hello" not in html:  # the last step's log line reaches the page too
        html = await communicator.receive_from(timeout=TIMEOUT)
    assert 'id="stop-button"' not in html  # a viewer gets no buttons
    await communicator.disconnect()


async def test_a_stranger_cannot_watch_a_deployment(deployment, channel_layer):
    from tests.factories import UserFactory

    stranger = await database_sync_to_async(UserFactory)(username="sam")
    _, connected, code = await connect(f"/ws/deployments/{deployment.pk}/", stranger)
    assert not connected and code == 4403


def test_the_page_polls_only_while_its_socket_is_down(operator_client, deployment, no_enqueue):
    lifecycle.start_deploy(deployment, deployment.created_by)
    page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert f'ws-connect="/ws/deployments/{deployment.pk}/"' in page
    assert f'hx-trigger="every 2s" data-poll-unless-live="deployment-{deployment.pk}"' in page
