"""Confirm checks that llama-server's port is free on the coordinator, in its real listener table (read over
its transport, as the reap step reads it): a port another program holds, the console's own included, is a
field error naming the holder, and nothing is confirmed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from django.urls import reverse

from deployments.models import Deployment
from tests.chat_fixtures import free_port

pytestmark = pytest.mark.django_db

PLAN = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7, "full": "1"}


def _confirm(client, model, port: int):
    return client.post(reverse("deployments:confirm", args=[model.pk]), {**PLAN, "port": str(port)})


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def foreign_server():
    """Another program listening on a port of this machine (the console's host, the plan's coordinator)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not _listening(port):
            assert process.poll() is None and time.monotonic() < deadline, "http.server did not listen"
            time.sleep(0.05)
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_port_another_program_holds_is_a_field_error_and_confirms_nothing(
    model, operator_client, foreign_server
):
    port, pid = foreign_server
    response = _confirm(operator_client, model, port)
    assert response.status_code == 409
    page = response.content.decode()
    assert f"Port {port} on desk is in use by " in page and f"PID {pid}" in page and "http.server" in page
    assert 'class="field has-error"' in page and f'value="{port}"' in page
    assert "Nothing was confirmed" in page
    assert not Deployment.objects.exists()


def test_the_consoles_own_port_is_named_as_such(model, operator_client):
    # This process stands for the console's web server: it listens, and the view runs in it.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        response = _confirm(operator_client, model, port)
    assert response.status_code == 409
    assert f"Port {port} on desk is in use by the console&#x27;s own web server" in response.content.decode()
    assert not Deployment.objects.exists()


def test_a_free_port_confirms(model, operator_client):
    port = free_port()
    response = _confirm(operator_client, model, port)
    assert response.status_code == 302
    assert Deployment.objects.get().port == port


def test_a_coordinator_that_cannot_be_asked_confirms_with_a_warning(model, pool, operator_client):
    """A node out of reach (here: no credential to log in with) cannot say; Deploy's reap step looks again."""
    pool["pc"].may_coordinate = True
    pool["pc"].save()
    both = [pool["pc"].pk, pool["desk"].pk]
    response = operator_client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {**PLAN, "coordinator": pool["pc"].pk, "nodes": both},
        follow=True,
    )
    assert response.status_code == 200 and Deployment.objects.count() == 1
    assert "Could not check whether port 8080 is free on pc" in response.content.decode()
