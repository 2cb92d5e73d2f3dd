"""The plan page's hints and the help page in a real browser, on a desktop (1280 px) and a phone (390 px):
the hints are shown beside their fields, the Help link is in the top bar (in the menu on a phone), and the
help page fits the window."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.browser


@pytest.mark.parametrize("width", [1280, 390])
def test_a_household_reads_the_hints_and_finds_the_words_on_the_help_page(
    live_server_url, page, split_model, width
):
    page.set_viewport_size({"width": width, "height": 860})
    UserFactory(username="vera-viewer", role="viewer")
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/models/{split_model.pk}/plan/")

    ctx_hint = page.locator("#field-ctx .help")
    expect(ctx_hint).to_be_visible()
    expect(ctx_hint).to_have_text(
        "How much of the conversation it remembers, in tokens; this model was trained for 4,096."
    )
    expect(page.locator("#field-parallel .help")).to_contain_text("How many conversations it answers at once")
    expect(page.locator("#field-cache_type .help")).to_contain_text("q8_0 half the memory")
    expect(page.locator("#blocks-hint")).to_be_visible()
    expect(page.locator("#fit-hint")).to_contain_text("--fit off keeps llama.cpp to this plan's split")

    # The hint's "more" goes to the word on the help page.
    page.click("#blocks-hint >> text=more")
    page.wait_for_url(f"{live_server_url}/help/#layers")
    expect(page.locator("#layers")).to_be_in_viewport()
    expect(page.locator("#layers")).to_contain_text("output layer")

    # From any page: the top bar's Help link (folded into the menu on a phone).
    page.goto(f"{live_server_url}/")
    if width == 390:
        expect(page.locator("#help-link")).to_be_hidden()
        page.click("#menu-toggle")
    page.click("#help-link")
    page.wait_for_url(f"{live_server_url}/help/")
    for word in ("context", "kv-cache", "layers", "split", "rpc-worker", "coordinator", "tokens-per-second",
                 "quantisation", "calibration"):  # fmt: skip
        expect(page.locator(f"#{word} h2")).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= width
