"""In a real browser: an operator types in a running deployment's chat box and watches the answer of a real
llama-server stream in, piece by piece, through the console; the API key never reaches the page. One small
deployment on the console's own host (tests/chat_fixtures.py)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from deployments.models import DeploymentState
from tests.browser import in_own_thread, log_in
from tests.chat_fixtures import ALIAS, deploy, local_deployment, stop
from tests.factories import PASSWORD, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.llamacpp, pytest.mark.e2e, pytest.mark.timeout(900)]
MAX_TOKENS = 192  # long enough to take several network reads even when the machine is busy


@pytest.fixture
def short_answers(settings):
    """Set before the live server forks, so it answers with at most MAX_TOKENS tokens."""
    settings.RAMDECK_CHAT_MAX_TOKENS = MAX_TOKENS


def test_an_operator_chats_with_a_running_deployment_and_sees_the_answer_stream_in(
    short_answers, live_server_url, page, tmp_path, monkeypatch
):
    operator = UserFactory(username="oscar-operator", role="operator")
    # Starting and stopping on the console's own host is an admin's; chatting with it is an operator's.
    admin = UserFactory(username="alice-admin", role="admin")
    # Room for a conversation of two turns (the byte-level vocabulary makes every character a token).
    deployment = local_deployment(tmp_path, operator, trained=4096, asked=2048)
    try:
        deployment = in_own_thread(deploy, deployment, admin, monkeypatch, timeout=600)
        assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
        key = deployment.api_key()
        log_in(page, live_server_url, "oscar-operator", PASSWORD)
        page.goto(f"{live_server_url}/deployments/{deployment.pk}/run/")
        expect(page.locator("#chat-model")).to_have_text(ALIAS)
        expect(page.locator("#chat-send")).to_be_enabled()
        expect(page.locator("#chat-stop")).to_be_hidden()  # only while an answer streams
        assert key not in page.content()

        # Count how often the answer's text changes while it arrives.
        page.evaluate(
            """() => {
            window.chatUpdates = 0;
            window.chatBatches = 0;
            const inAnswer = (node) => (node.nodeType === 1 ? node : node.parentElement)
                ?.closest('.assistant .chat-text');
            new MutationObserver((records) => {
                const ours = records.filter((r) => inAnswer(r.target)).length;
                window.chatUpdates += ours;
                if (ours) window.chatBatches += 1;
            }).observe(document.getElementById('chat-log'),
                       {subtree: true, childList: true, characterData: true});
        }"""
        )
        page.fill("#chat-input", "Tell me a story about a fox.")
        page.press("#chat-input", "Enter")
        expect(page.locator(".chat-message.user .chat-text")).to_have_text("Tell me a story about a fox.")
        answer = page.locator(".chat-message.assistant")
        expect(answer.locator(".chat-meta")).to_contain_text("tokens", timeout=120_000)
        expect(answer).not_to_have_class("streaming")
        assert answer.locator(".chat-text").inner_text().strip()
        updates, batches = page.evaluate("[window.chatUpdates, window.chatBatches]")
        print(f"\nCHAT {updates} updates of the answer in {batches} batches")
        # It grew in pieces, as they arrived, not in one block (a random-weights model may write a few
        # bytes that join into one character, so the answer is asked to be long enough to show it).
        assert updates >= 2 and batches >= 2
        expect(page.locator("#chat-error")).to_be_hidden()
        expect(page.locator("#chat-input")).to_have_value("")

        # The conversation goes on in the page: the second answer follows the first.
        page.fill("#chat-input", "And then?")
        page.click("#chat-send")
        expect(page.locator(".chat-message.assistant .chat-meta")).to_have_count(2, timeout=120_000)
        assert key not in page.content()

        # Stopped: the page hears it over its websocket and the box closes, saying why; a new page has none.
        deployment = in_own_thread(stop, deployment, admin, monkeypatch, timeout=600)
        assert deployment.state == DeploymentState.STOPPED
        expect(page.locator("#chat-unavailable")).to_be_visible(timeout=30_000)
        expect(page.locator("#chat-send")).to_be_disabled()
        expect(page.locator(".chat-message.assistant")).to_have_count(2)  # the conversation stays readable
        page.reload()
        expect(page.locator("#chat")).to_have_count(0)
    finally:
        if deployment.state not in (DeploymentState.STOPPED, DeploymentState.FAILED):
            in_own_thread(stop, deployment, admin, monkeypatch, timeout=600)
