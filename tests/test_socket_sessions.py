"""Open websockets end with the session or the role that let them open (jobs/watchers.py), through the real
ASGI stack and the real Redis layer."""

from __future__ import annotations

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client
from django.urls import reverse

from ramdeck_site.asgi import application
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 15


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


async def open_socket(path: str, client: Client) -> WebsocketCommunicator:
    cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
    headers = [
        (b"origin", b"http://127.0.0.1"),
        (b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()),
    ]
    communicator = WebsocketCommunicator(application, path, headers=headers)
    connected, _ = await communicator.connect(timeout=TIMEOUT)
    assert connected
    return communicator


async def closed_with(communicator: WebsocketCommunicator) -> int:
    while True:
        event = await communicator.receive_output(timeout=TIMEOUT)
        if event["type"] == "websocket.close":
            return event.get("code")


async def test_logging_out_closes_that_sessions_sockets_and_no_other(channel_layer):
    user = await database_sync_to_async(UserFactory)(username="vera", role="viewer")
    here, elsewhere = (
        await database_sync_to_async(logged_in)(user),
        await database_sync_to_async(logged_in)(user),
    )
    mine = await open_socket("/ws/jobs/", here)
    other = await open_socket("/ws/jobs/", elsewhere)

    await database_sync_to_async(here.post)(reverse("logout"))

    assert await closed_with(mine) == 4401
    assert await other.receive_nothing(timeout=1.0)  # the same user's other browser stays connected
    await other.disconnect()


async def test_losing_the_role_closes_every_socket_of_the_user(channel_layer):
    from deployments.models import Deployment, ModelFile
    from tests.factories import NodeFactory

    user = await database_sync_to_async(UserFactory)(username="oscar", role="operator")

    def a_deployment():
        node = NodeFactory(name="desk")
        model = ModelFile.objects.create(name="tiny", node=node, path="/m/tiny.gguf")
        return Deployment.objects.create(name="tiny", model_file=model, coordinator=node, plan={})

    deployment = await database_sync_to_async(a_deployment)()
    client = await database_sync_to_async(logged_in)(user)
    page = await open_socket(f"/ws/deployments/{deployment.pk}/", client)
    await page.receive_from(timeout=TIMEOUT)  # the first render
    jobs = await open_socket("/ws/jobs/", client)

    await database_sync_to_async(user.groups.clear)()

    assert await closed_with(page) == 4403
    assert await closed_with(jobs) == 4403
