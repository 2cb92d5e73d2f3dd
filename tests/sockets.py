"""Websocket helpers for tests: a session cookie, a connected communicator through the real ASGI stack."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from ramdeck_site.asgi import application
from tests.factories import UserFactory

# Seconds a test waits for a websocket to connect or to send.
TIMEOUT = 15


def session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


async def connect(path: str, user=None) -> tuple[WebsocketCommunicator, bool, int | None]:
    headers = [(b"origin", b"http://127.0.0.1")]
    if user is not None:
        cookie = await database_sync_to_async(session_cookie)(user)
        headers.append((b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()))
    communicator = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await communicator.connect(timeout=TIMEOUT)
    return communicator, connected, code


@database_sync_to_async
def viewer():
    return UserFactory(username="vera-viewer", role="viewer")


@database_sync_to_async
def watcher():
    """Who watches the logs here: the jobs run on the console's own host (local_node), whose logs are the
    admins' (jobs/models.py `may_read_log`)."""
    return UserFactory(username="alice-watcher", role="admin")
