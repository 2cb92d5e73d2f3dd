"""The console's chat (chat/views.py): who may chat, what it refuses and why, and the relay of an
OpenAI-style stream. llama-server is a small HTTP server here that streams as llama-server does; the real one
answers in tests/chat/test_chat_llamacpp.py and in the browser in tests/chat/test_chat_browser.py."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from django.test import Client
from django.urls import reverse

from chat.relay import ChatInputError, parse_conversation, relay
from deployments.models import DeploymentState
from tests.chat_fixtures import KEY, chat_deployment, chat_events, delta, post_chat, stand_in_llama_server
from tests.factories import NodeFactory

# --------------------------------------------------------------------------------------------------
# The conversation posted by the page


def test_a_conversation_is_checked_before_anything_is_sent():
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert parse_conversation(json.dumps({"messages": [*ok, {"role": "user", "content": "more"}]}).encode())
    for body, message in [
        (b"not json", "not JSON"),
        (b"{}", "no messages"),
        (json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(), "role (system, user or"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "text content"),
        (json.dumps({"messages": ok}).encode(), "Type a message first"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 200_001}]}).encode(), "too long"),
    ]:
        with pytest.raises(ChatInputError, match=re.escape(message)):
            parse_conversation(body)


async def _collect(lines: list[str]) -> list[dict]:
    async def source():
        for line in lines:
            yield line

    return [json.loads(event[6:]) async for event in relay(source())]


async def test_the_relay_passes_text_as_it_comes_and_ends_with_the_speed():
    timings = {"predicted_n": 2, "predicted_per_second": 12.5}
    lines = [
        'data: {"choices": [{"delta": {"role": "assistant", "content": null}}]}',
        "",
        f"data: {delta('Hel')}",
        f"data: {delta('lo')}",
        f"data: {delta('', finish='length', timings=timings)}",
        "data: [DONE]",
    ]
    events = await _collect(lines)
    assert events == [
        {"delta": "Hel"},
        {"delta": "lo"},
        {"done": True, "finish_reason": "length", "tokens": 2, "tokens_per_s": 12.5},
    ]


async def test_an_error_in_the_stream_is_relayed_as_one_readable_line():
    events = await _collect([f"data: {delta('a')}", 'error: {"code": 500, "message": "context full"}'])
    assert events == [{"delta": "a"}, {"error": "context full"}]


# --------------------------------------------------------------------------------------------------
# The view


@pytest.mark.django_db(transaction=True)
def test_an_operator_chats_and_the_key_stays_on_the_console(local_node, operator_user, operator_client):
    seen: list[dict] = []
    server = stand_in_llama_server([delta("Once"), delta(" upon"), delta(" a time", finish="stop")], seen)
    try:
        deployment = chat_deployment(local_node, server.server_address[1], name="Family, model")
        assert deployment.chat_answered_at is None
        messages = [{"role": "user", "content": "Tell me a story"}]
        response = post_chat(operator_user, deployment, messages)
        assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
        assert response["Cache-Control"] == "no-cache"
        events = chat_events(response)
    finally:
        server.shutdown()
        server.server_close()
    assert [e["delta"] for e in events if "delta" in e] == ["Once", " upon", " a time"]
    assert events[-1]["done"] and events[-1]["finish_reason"] == "stop"
    # The first answer is noted (the first-run checklist's last tick); what was said is not.
    deployment.refresh_from_db()
    assert deployment.chat_answered_at is not None
    [call] = seen
    assert call["path"] == "/v1/chat/completions" and call["auth"] == f"Bearer {KEY}"
    assert call["body"]["model"] == "Family model" and call["body"]["stream"] is True
    assert call["body"]["messages"] == messages
    page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert 'id="chat-form"' in page and KEY not in page and "Chat with" in page


@pytest.mark.django_db(transaction=True)
def test_llama_servers_refusal_is_shown_as_its_reason(local_node, operator_user):
    seen: list[dict] = []
    server = stand_in_llama_server([], seen)
    try:
        deployment = chat_deployment(local_node, server.server_address[1])
        deployment.store_api_key("an old key")
        response = post_chat(operator_user, deployment, [{"role": "user", "content": "hi"}])
    finally:
        server.shutdown()
        server.server_close()
    assert response.status_code == 502
    assert response.json() == {"error": "llama-server answered 401: Invalid API Key"}


@pytest.mark.django_db(transaction=True)
def test_a_llama_server_that_does_not_answer_is_a_clear_error(local_node, operator_user):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free again once closed: nobody listens there
    deployment = chat_deployment(local_node, port)
    response = post_chat(operator_user, deployment, [{"role": "user", "content": "hi"}])
    assert response.status_code == 502
    assert response.json()["error"].startswith(f"llama-server at http://127.0.0.1:{port} did not answer")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "state", [DeploymentState.CONFIRMED, DeploymentState.LAUNCHING, DeploymentState.STOPPED]
)
def test_a_deployment_that_is_not_running_says_so(local_node, operator_user, state):
    deployment = chat_deployment(local_node, 9, state=state)
    response = post_chat(operator_user, deployment, [{"role": "user", "content": "hi"}])
    assert response.status_code == 409
    label = deployment.get_state_display().lower()
    assert response.json() == {"error": f"tiny deployment is {label}: chat works once llama-server answers."}


@pytest.mark.django_db(transaction=True)
def test_chat_opens_once_llama_server_answers_while_the_speed_is_still_measured(
    local_node, operator_user, operator_client
):
    """Verifying comes after the llama-server step saw /health answer: the verify and measure steps (about
    15 s) need not keep people from chatting."""
    seen: list[dict] = []
    server = stand_in_llama_server([delta("Hello", finish="stop")], seen)
    try:
        deployment = chat_deployment(local_node, server.server_address[1], state=DeploymentState.VERIFYING)
        response = post_chat(operator_user, deployment, [{"role": "user", "content": "hi"}])
        assert response.status_code == 200
        events = chat_events(response)
    finally:
        server.shutdown()
        server.server_close()
    assert [e["delta"] for e in events if "delta" in e] == ["Hello"] and len(seen) == 1
    page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert 'id="chat-form"' in page and 'id="deployment-state">Verifying' in page


@pytest.mark.django_db(transaction=True)
def test_viewers_may_not_chat_and_chat_is_post_only(local_node, viewer_user, operator_client):
    deployment = chat_deployment(local_node, 9)
    assert post_chat(viewer_user, deployment, [{"role": "user", "content": "hi"}]).status_code == 403
    viewer = Client()
    viewer.force_login(viewer_user)
    page = viewer.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert 'id="chat-viewer-note"' in page and 'id="chat-form"' not in page and "Chat with it" not in page
    assert operator_client.get(reverse("chat:deployment", args=[deployment.pk])).status_code == 405


@pytest.mark.django_db(transaction=True)
def test_the_chat_role_chats_sees_the_endpoint_and_its_key_and_nothing_more(
    local_node, chat_user, chat_client
):
    seen: list[dict] = []
    server = stand_in_llama_server([delta("Hello", finish="stop")], seen)
    try:
        deployment = chat_deployment(local_node, server.server_address[1])
        response = post_chat(chat_user, deployment, [{"role": "user", "content": "hi"}])
        assert response.status_code == 200
        assert [e["delta"] for e in chat_events(response) if "delta" in e] == ["Hello"]
    finally:
        server.shutdown()
        server.server_close()
    page = chat_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert (
        'id="chat-form"' in page
        and 'href="#chat" data-action="chat:deployment">Chat with it<' in page
        and 'id="endpoint-url"' in page
    )
    # Nothing that changes the cluster: no button, and a refusal when asked anyway.
    for button in ("stop-button", "restart-button", "deploy-button", "redeploy-button", "self-heal-button"):
        assert f'id="{button}"' not in page
    assert (
        chat_client.post(reverse("deployments:stop", args=[deployment.pk]), {"confirm": "yes"}).status_code
        == 403
    )
    assert chat_client.post(reverse("deployments:restart", args=[deployment.pk])).status_code == 403
    # The key of a deployment elsewhere than on the console's own host is shown, as to an operator.
    elsewhere = chat_deployment(NodeFactory(name="attic", address="10.77.1.9"), 8080, name="other")
    page = chat_client.get(reverse("deployments:run", args=[elsewhere.pk])).content.decode()
    assert "Show API key" in page
    assert KEY in chat_client.get(reverse("deployments:api_key", args=[elsewhere.pk])).content.decode()
    # The console's own host's key stays the admins'.
    assert chat_client.get(reverse("deployments:api_key", args=[deployment.pk])).status_code == 403
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING


@pytest.mark.django_db(transaction=True)
def test_a_bad_conversation_is_refused_with_its_reason(local_node, operator_user):
    deployment = chat_deployment(local_node, 9)
    response = post_chat(operator_user, deployment, [{"role": "user", "content": "  "}])
    assert response.status_code == 400 and response.json() == {"error": "Type a message first."}


def test_a_page_that_goes_away_ends_the_answer_at_llama_server_too(
    local_node, operator_user, live_server_url
):
    """Through daphne: the reader hangs up after the first piece; the console closes its connection to
    llama-server (which then stops generating) instead of reading the answer to its end."""
    seen: list[dict] = []
    server = stand_in_llama_server([delta(f"word{i} ") for i in range(100)], seen, pause=0.1)
    try:
        deployment = chat_deployment(local_node, server.server_address[1])
        web = Client()
        web.force_login(operator_user)
        cookies = {name: morsel.value for name, morsel in web.cookies.items()}
        with httpx.Client(base_url=live_server_url, cookies=cookies, timeout=30) as browser:
            browser.get(reverse("deployments:run", args=[deployment.pk]))
            with browser.stream(
                "POST",
                reverse("chat:deployment", args=[deployment.pk]),
                json={"messages": [{"role": "user", "content": "talk"}]},
                headers={"X-CSRFToken": browser.cookies["csrftoken"]},
            ) as response:
                assert response.status_code == 200
                first = next(response.iter_lines())
                assert first.startswith("data:") and "word0" in first
        deadline = time.monotonic() + 10
        while not seen[0].get("hung_up") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.shutdown()
        server.server_close()
    assert seen[0].get("hung_up"), seen[0].get("written")
    assert seen[0]["written"] < 100


@pytest.mark.django_db(transaction=True)
def test_a_database_that_cannot_note_the_first_answer_does_not_break_the_chat(
    local_node, operator_user, monkeypatch, caplog
):
    from django.db import OperationalError
    from django.db.models import QuerySet

    real_update = QuerySet.update

    def update(queryset, **fields):
        if "chat_answered_at" in fields:
            raise OperationalError("server closed the connection unexpectedly")
        return real_update(queryset, **fields)

    monkeypatch.setattr(QuerySet, "update", update)
    seen: list[dict] = []
    server = stand_in_llama_server([delta("Still"), delta(" here", finish="stop")], seen)
    try:
        deployment = chat_deployment(local_node, server.server_address[1])
        events = chat_events(post_chat(operator_user, deployment, [{"role": "user", "content": "Hello"}]))
    finally:
        server.shutdown()
        server.server_close()
    assert [e["delta"] for e in events if "delta" in e] == ["Still", " here"]
    assert events[-1]["done"] and not any("error" in e for e in events)
    assert "first chat answer" in caplog.text
    deployment.refresh_from_db()
    assert deployment.chat_answered_at is None
