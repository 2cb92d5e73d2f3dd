"""In a real browser, at a desktop's and a phone's width: a family member with the chat role meets a running
deployment's endpoint, "Chat with it" (which lands on the chat box) and the API key button, and no button
that changes the cluster; a viewer is offered no chat at all, only who may. The chat itself, with a real
llama-server, is tests/chat/test_chat_browser.py."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser import SCREENSHOT_WIDTHS, log_in
from tests.chat_fixtures import chat_deployment
from tests.factories import PASSWORD, NodeFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


def test_the_chat_role_is_offered_the_chat_and_the_key_and_a_viewer_neither(live_server_url, page):
    # On another machine than the console's own: its key is not the admins' alone.
    deployment = chat_deployment(NodeFactory(name="attic", address="10.77.1.9"), 8080, name="family")
    UserFactory(username="cleo-chat", role="chat")
    UserFactory(username="vera-viewer", role="viewer")
    url = f"{live_server_url}/deployments/{deployment.pk}/run/"
    for username in ("cleo-chat", "vera-viewer"):
        page.context.clear_cookies()
        log_in(page, live_server_url, username, PASSWORD)
        for width in SCREENSHOT_WIDTHS:
            page.set_viewport_size({"width": width, "height": 900})
            page.goto(url)
            expect(page.locator("#endpoint-url")).to_be_visible()
            for button in ("#stop-button", "#restart-button", "#deploy-button", "#self-heal-button"):
                expect(page.locator(button)).to_have_count(0)
            chat_link = page.get_by_role("link", name="Chat with it")
            if username == "cleo-chat":
                expect(page.get_by_role("link", name="Show API key and example")).to_be_visible()
                chat_link.click()
                expect(page.locator("#chat-input")).to_be_in_viewport()
                expect(page.locator("#chat-send")).to_be_visible()
            else:
                expect(chat_link).to_have_count(0)
                expect(page.locator("#chat-form")).to_have_count(0)
                expect(page.locator("#chat-viewer-note")).to_contain_text(
                    "An admin can give you the chat role"
                )
                expect(page.get_by_role("link", name="Show API key and example")).to_have_count(0)
