"""Open websockets end with the session or the role that let them open (jobs/sockets.py), through the real
ASGI stack and the real Redis layer."""

from __future__ import annotations

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client
from django.urls import reverse

from ramdeck_site.asgi import application
from tests.factories import PASSWORD, UserFactory

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
    from deployments.models import Deployment
    from modelfiles.models import ModelFile
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


@pytest.mark.security
async def test_a_new_password_closes_every_socket_of_the_user_and_no_one_elses(channel_layer):
    """Changed on the console's password page (that session goes on with a new key) or by an admin: every
    session of the user ends, and so does every socket they had open."""
    from django.contrib.auth import get_user_model

    user = await database_sync_to_async(UserFactory)(username="vera", role="viewer")
    other = await database_sync_to_async(UserFactory)(username="oscar", role="operator")
    here, elsewhere, theirs = [await database_sync_to_async(logged_in)(who) for who in (user, user, other)]
    mine = await open_socket("/ws/jobs/", here)
    my_other = await open_socket("/ws/dashboard/", elsewhere)
    not_mine = await open_socket("/ws/jobs/", theirs)

    new = "a-new-long-passphrase-9"
    response = await database_sync_to_async(here.post)(
        reverse("password_change"), {"old_password": PASSWORD, "new_password1": new, "new_password2": new}
    )
    assert response.status_code == 302

    assert await closed_with(mine) == 4401
    assert await closed_with(my_other) == 4401
    assert await not_mine.receive_nothing(timeout=1.0)

    # The same from an admin's side (Django admin, `manage.py changepassword`: set_password and save).
    again = await database_sync_to_async(logged_in)(other)
    second = await open_socket("/ws/jobs/", again)

    def reset_by_admin():
        target = get_user_model().objects.get(pk=other.pk)
        target.set_password("another-long-passphrase-7")
        target.save()

    await database_sync_to_async(reset_by_admin)()
    assert await closed_with(not_mine) == 4401
    assert await closed_with(second) == 4401


@pytest.mark.security
async def test_saving_a_user_without_a_new_password_closes_nothing(channel_layer):
    user = await database_sync_to_async(UserFactory)(username="vera", role="viewer")
    client = await database_sync_to_async(logged_in)(user)
    socket = await open_socket("/ws/jobs/", client)

    def save_unchanged():
        user.email = "vera@example.test"
        user.save()

    await database_sync_to_async(save_unchanged)()
    assert await socket.receive_nothing(timeout=1.0)
    await socket.disconnect()
