"""The endpoint choice on the plan page in a real browser: it survives the plan's live recomputes and the
Confirm button sends it (the inputs sit in the plan's region and belong to the Confirm form by
form="confirm-form")."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from deployments.models import Deployment
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.browser


def test_an_operator_opens_the_endpoint_to_the_network_on_another_port_and_confirms(
    live_server_url, page, split_model
):
    UserFactory(username="oscar-operator", role="operator")
    log_in(page, live_server_url, "oscar-operator", PASSWORD)
    page.goto(f"{live_server_url}/models/{split_model.pk}/plan/")
    page.fill("input[name=ctx]", "512")
    expect(page.locator("#server-command")).to_contain_text("-c 512")
    # desk is the console's own host: loopback is what it recommends and starts with.
    expect(page.locator("#reach-loopback")).to_be_checked()
    page.check("#reach-all")
    page.fill("#endpoint-port", "9123")
    # The plan recomputes (htmx) when the context changes; the choice goes along and comes back chosen.
    page.fill("input[name=ctx]", "1024")
    expect(page.locator("#server-command")).to_contain_text("-c 1024")
    expect(page.locator("#reach-all")).to_be_checked()
    expect(page.locator("#endpoint-port")).to_have_value("9123")
    page.click("#confirm-plan")
    expect(page.locator("#deployment-state")).to_have_text("Confirmed")
    deployment = Deployment.objects.get()
    assert (deployment.host, deployment.port) == ("0.0.0.0", 9123)
    expect(page.locator("body")).to_contain_text("--host 0.0.0.0 --port 9123")
