"""The split by hand in a real browser: an operator types blocks per device and sees the split's predicted
speed and memory beside the planner's, and a field error when a device is over its memory (htmx swaps the
region; nothing is stored)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from deployments.models import Deployment
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.browser


def test_an_operator_enters_a_split_and_sees_its_predicted_speed(live_server_url, page, split_model):
    UserFactory(username="oscar-operator", role="operator")
    log_in(page, live_server_url, "oscar-operator", PASSWORD)
    page.goto(f"{live_server_url}/models/{split_model.pk}/plan/?ctx=1024")
    expect(page.locator("#manual-split")).to_be_visible()
    expect(page.locator("#manual-tps")).to_have_text("—")
    planned = page.locator("#predicted-tps").inner_text()

    page.fill("#manual-layers_0", "3")
    page.fill("#manual-layers_1", "5")
    page.click("#manual-check")
    expect(page.locator("#manual-tps")).to_contain_text("tok/s")
    expect(page.locator('[data-manual-memory="pc/CPU"]')).to_contain_text("MiB of")
    assert page.locator("#predicted-tps").inner_text() == planned  # the planner's stays beside it
    assert "/plan/" in page.url and "manual" not in page.url  # swapped in place

    # Every block on the small worker: its field says what it would need and what it has.
    page.fill("#manual-layers_0", "0")
    page.fill("#manual-layers_1", "8")
    page.click("#manual-check")
    expect(page.locator("#manual-errors-layers_1")).to_contain_text("pc / CPU would need")
    expect(page.locator("#manual-tps")).to_contain_text("not a valid split")
    expect(page.locator("#deploy-by-hand")).to_have_count(0)
    assert not Deployment.objects.exists()
