"""Confirm leads straight to Deploy, in a real browser at desktop and phone width: "Confirm and deploy" on the
plan page lands on the run page with the run started; after a plain Confirm, Deploy is the first thing the
next page offers, in the first screenful. No worker runs here: the deploy run stays queued."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from audit.models import AuditEvent
from builds.models import Build, BuildSource
from deployments.models import Deployment, DeploymentState
from jobs.models import Job
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.browser
WIDTHS = {1280: 900, 390: 844}


def _build(node) -> None:
    Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        rpc_protocol="7.0.0",
        rpc_server_path="/opt/llama/ggml-rpc-server",
        llama_server_path="/opt/llama/llama-server",
    )


def _within_first_screen(page, selector: str) -> None:
    box = page.locator(selector).bounding_box()
    viewport = page.viewport_size
    assert box is not None, selector
    assert box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"], (selector, box, viewport)
    assert box["y"] + box["height"] <= viewport["height"], (selector, box, viewport)


@pytest.fixture
def built_pool(split_model):
    for node in {split_model.node, *type(split_model.node).objects.all()}:
        _build(node)
    return split_model


@pytest.mark.parametrize("width", WIDTHS)
def test_an_admin_confirms_and_deploys_in_one_step(no_enqueue, built_pool, live_server_url, page, width):
    model = built_pool
    page.set_viewport_size({"width": width, "height": WIDTHS[width]})
    UserFactory(username="alice-admin", role="admin")
    log_in(page, live_server_url, "alice-admin", PASSWORD)
    page.goto(f"{live_server_url}/models/{model.pk}/plan/")
    page.fill("#id_ctx", "512")
    expect(page.locator("#server-command")).to_contain_text("-c 512")
    button = page.locator("#confirm-deploy")
    expect(button).to_be_enabled()
    button.scroll_into_view_if_needed()
    box = button.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= width
    button.click()
    expect(page.locator("#deployment-state")).to_have_text("Preparing")
    deployment = Deployment.objects.get()
    assert page.url.endswith(f"/deployments/{deployment.pk}/run/")
    assert deployment.state == DeploymentState.PREPARING and deployment.plan["settings"]["ctx"] == 512
    expect(page.locator("#steps")).to_contain_text(f"Start llama-server on {model.node.name}")
    assert Job.objects.filter(kind="deploy", params__deployment=deployment.pk).count() == 1
    actions = set(AuditEvent.objects.values_list("action", flat=True))
    assert {"deployment.confirm", "deployment.deploy"} <= actions


@pytest.mark.parametrize("width", WIDTHS)
def test_after_confirm_the_next_page_puts_deploy_first(no_enqueue, built_pool, live_server_url, page, width):
    model = built_pool
    page.set_viewport_size({"width": width, "height": WIDTHS[width]})
    UserFactory(username="alice-admin", role="admin")
    log_in(page, live_server_url, "alice-admin", PASSWORD)
    page.goto(f"{live_server_url}/models/{model.pk}/plan/")
    page.fill("#id_ctx", "512")
    expect(page.locator("#server-command")).to_contain_text("-c 512")
    expect(page.locator("#confirm-plan")).to_be_enabled()
    page.click("#confirm-plan")
    expect(page.locator("#deployment-state")).to_have_text("Confirmed")
    expect(page.locator("#next-step")).to_contain_text("Next: deploy it")
    _within_first_screen(page, "#deploy-button")
    page.click("#deploy-button")
    expect(page.locator("#deployment-state")).to_have_text("Preparing")
    assert Deployment.objects.get().state == DeploymentState.PREPARING
