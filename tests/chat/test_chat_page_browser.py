"""A deployment's chat on a page of its own, in a real browser at desktop and phone width: the conversation
fills the window (it scrolls inside, the page does not grow), Enter sends, Shift+Enter and the New line
button put a line break in the message; the box opens while the deployment verifies (llama-server answers
by then) and closes when it stops. llama-server is a stand-in that streams as it does
(tests/chat_fixtures.py); the real one answers in tests/chat/test_chat_browser.py."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from deployments.models import Deployment, DeploymentState
from tests.browser import log_in
from tests.chat_fixtures import KEY, chat_deployment, delta, stand_in_llama_server
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.browser
WIDTHS = {1280: 900, 390: 844}


def _no_page_scroll(page) -> None:
    height, inner = page.evaluate("[document.documentElement.scrollHeight, window.innerHeight]")
    assert height <= inner + 1, f"the page is {height} px tall in a {inner} px window"


def _inside_window(page, selector: str) -> None:
    box = page.locator(selector).bounding_box()
    viewport = page.viewport_size
    assert box is not None, selector
    assert box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"] + 0.5, (selector, box)
    assert box["y"] >= 0 and box["y"] + box["height"] <= viewport["height"] + 0.5, (selector, box)


def _sent(page, count: int) -> None:
    """Waits for the `count`th question in the conversation; when it does not come, says what the box looked
    like (a question the page dropped keeps its text in the box)."""
    try:
        expect(page.locator(".chat-message.user")).to_have_count(count)
    except AssertionError:
        state = page.evaluate(
            """() => ({input: document.getElementById("chat-input").value,
                       inputDisabled: document.getElementById("chat-input").disabled,
                       sendDisabled: document.getElementById("chat-send").disabled,
                       badge: document.getElementById("deployment-state")?.outerHTML ?? null,
                       error: document.getElementById("chat-error").textContent})"""
        )
        raise AssertionError(f"question {count} was not sent: {state}") from None


def _answered(page, count: int, seen: list[dict]) -> None:
    """Waits for the `count`th finished answer; when it does not come, says what the page and the stand-in
    saw (an error the console gave, or no request at all), not only the count."""
    try:
        expect(page.locator(".chat-message.assistant:not(.streaming) .chat-text")).to_have_count(count)
    except AssertionError:
        error = page.locator("#chat-error")
        shown = error.text_content() if error.is_visible() else "(no error shown)"
        raise AssertionError(
            f"answer {count} did not finish: the chat's error box says {shown!r}; llama-server's stand-in "
            f"was asked {len(seen)} times"
        ) from None


@pytest.fixture
def llama(transactional_db):
    seen: list[dict] = []
    server = stand_in_llama_server([delta("Once"), delta(" upon"), delta(" a time", finish="stop")], seen)
    yield server.server_address[1], seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_chat_page_fills_a_phone_and_enter_sends_while_shift_enter_adds_a_line(
    local_node, live_server_url, llama, page, width
):
    port, seen = llama
    page.set_viewport_size({"width": width, "height": WIDTHS[width]})
    UserFactory(username="oscar-operator", role="operator")
    deployment = chat_deployment(local_node, port, state=DeploymentState.VERIFYING)
    log_in(page, live_server_url, "oscar-operator", PASSWORD)
    page.goto(f"{live_server_url}/deployments/{deployment.pk}/run/")
    page.click("#chat-page-link")
    page.wait_for_url(f"{live_server_url}/deployments/{deployment.pk}/chat/page/")

    # Verifying: llama-server already answers, so the box is open.
    expect(page.locator("#deployment-state")).to_have_text("Verifying")
    expect(page.locator("#chat-send")).to_be_enabled()
    for selector in ("#chat-input", "#chat-send", "#chat-newline"):
        _inside_window(page, selector)
    _no_page_scroll(page)
    chat_box = page.locator("#chat").bounding_box()
    assert chat_box["y"] + chat_box["height"] >= WIDTHS[width] - 40  # it reaches the foot of the window

    page.click("#chat-input")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    page.click("#chat-newline")
    page.keyboard.type("three")
    expect(page.locator("#chat-input")).to_have_value("line one\nline two\nthree")
    expect(page.locator(".chat-message")).to_have_count(0)  # nothing was sent yet
    page.keyboard.press("Enter")
    expect(page.locator(".chat-message.user .chat-text")).to_have_text("line one\nline two\nthree")
    answer = page.locator(".chat-message.assistant").last
    expect(answer.locator(".chat-text")).to_have_text("Once upon a time")
    expect(answer).not_to_have_class("streaming")
    assert seen[-1]["auth"] == f"Bearer {KEY}" and KEY not in page.content()
    assert seen[-1]["body"]["messages"][-1]["content"] == "line one\nline two\nthree"

    # A long conversation scrolls inside its box; the page stays the window's height.
    # Sent with the Send button (Enter was tested above): a click waits until the button is enabled.
    for turn in range(6):
        page.fill("#chat-input", f"question {turn}")
        page.click("#chat-send")
        _sent(page, turn + 2)
        _answered(page, turn + 2, seen)
    _no_page_scroll(page)
    _inside_window(page, "#chat-input")
    log_height, log_view = page.locator("#chat-log").evaluate("log => [log.scrollHeight, log.clientHeight]")
    assert log_height > log_view, "the conversation should scroll inside its box"

    # Stopped: the page's state poll hears it and the box closes, saying why.
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPED)
    expect(page.locator("#deployment-state")).to_have_text("Stopped", timeout=15_000)
    expect(page.locator("#chat-unavailable")).to_be_visible()
    expect(page.locator("#chat-send")).to_be_disabled()


def test_a_viewer_is_told_who_may_chat(local_node, live_server_url, page):
    UserFactory(username="vera-viewer", role="viewer")
    deployment = chat_deployment(local_node, 9)
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/deployments/{deployment.pk}/chat/page/")
    expect(page.locator("#chat-viewer-note")).to_be_visible()
    expect(page.locator("#chat-form")).to_have_count(0)
