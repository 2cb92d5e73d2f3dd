"""The plan preview in a real browser: change the context, watch the bars and the prediction change, confirm
as an operator; a viewer sees no Confirm button and is refused when posting anyway."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from audit.models import AuditEvent
from deployments.models import Deployment, DeploymentState
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.browser
MIB = 1024 * 1024


def bar_widths(page) -> list[str]:
    """The KV segments' width classes (p0…p100) on every bar of this plan."""
    return page.locator("#plan .stack .seg.kv").evaluate_all("els => els.map(e => e.className)")


def test_operator_changes_the_context_watches_the_plan_and_confirms(live_server_url, page, split_model):
    UserFactory(username="oscar-operator", role="operator")
    log_in(page, live_server_url, "oscar-operator", PASSWORD)
    page.goto(f"{live_server_url}/models/")
    expect(page.locator(f"#model-{split_model.pk}")).to_contain_text("fits")
    page.click(f"#model-{split_model.pk} >> text=Plan")

    page.fill("#id_ctx", "512")
    expect(page.locator("#server-command")).to_contain_text("-c 512")
    tps_small = page.locator("#predicted-tps").inner_text()
    kv_small = bar_widths(page)
    expect(page.locator("#baseline-tps")).to_be_visible()

    page.fill("#id_ctx", "1024")
    expect(page.locator("#server-command")).to_contain_text("-c 1024")
    assert page.locator("#predicted-tps").inner_text() != tps_small
    assert bar_widths(page) != kv_small  # the KV share of the bars grew
    expect(page.locator('[data-device="pc/CPU"]')).to_be_visible()

    assert "csrfmiddlewaretoken" not in page.url and "ctx=1024" in page.url  # the recompute's address
    page.fill("#id_name", "tiny for the family")
    page.click("#confirm-plan")
    expect(page.locator("#deployment-state")).to_have_text("Confirmed")
    deployment = Deployment.objects.get()
    assert deployment.state == DeploymentState.CONFIRMED and deployment.plan["settings"]["ctx"] == 1024


def test_viewer_can_look_but_not_confirm(live_server_url, page, split_model):
    UserFactory(username="vera-viewer", role="viewer")
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/models/{split_model.pk}/plan/")
    expect(page.locator("#predicted-tps")).to_be_visible()
    expect(page.locator("#confirm-plan")).to_have_count(0)
    token = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    response = page.request.post(
        f"{live_server_url}/models/{split_model.pk}/plan/confirm/",
        form={"ctx": "1024", "parallel": "1", "cache_type": "f16", "clamp": "0.7"},
        headers={"X-CSRFToken": token, "Referer": f"{live_server_url}/models/{split_model.pk}/plan/"},
    )
    assert response.status == 403
    assert not Deployment.objects.exists()
    # Refused for the role (audited), not for a missing CSRF token.
    assert AuditEvent.objects.filter(action="permission_denied", actor_name="vera-viewer").exists()


def test_a_context_too_long_marks_the_field_and_the_shown_plan_as_stale(live_server_url, page, split_model):
    UserFactory(username="oscar-operator", role="operator")
    log_in(page, live_server_url, "oscar-operator", PASSWORD)
    page.goto(f"{live_server_url}/models/{split_model.pk}/plan/")
    page.fill("#id_ctx", "1024")
    expect(page.locator("#server-command")).to_contain_text("-c 1024")
    expect(page.locator("#confirm-plan")).to_be_enabled()

    page.fill("#id_ctx", "2000000")
    expect(page.locator("#errors-ctx")).to_contain_text("Context: Ensure this value is less than or equal to")
    expect(page.locator("#plan-stale")).to_contain_text("Stale: the plan below is for the previous values")
    expect(page.locator("#plan-stale")).to_contain_text("Context: Ensure this value is less than or equal to")
    # The plan shown is still the one for 1024, greyed, and it cannot be confirmed.
    expect(page.locator("#server-command")).to_contain_text("-c 1024")
    assert page.locator("#plan .evidence").evaluate("e => getComputedStyle(e).opacity") == "0.45"
    expect(page.locator("#confirm-plan")).to_be_disabled()
    expect(page.locator("#id_ctx")).to_have_value("2000000")  # kept, for the user to fix

    page.fill("#id_ctx", "512")
    expect(page.locator("#server-command")).to_contain_text("-c 512")
    expect(page.locator("#errors-ctx")).to_be_empty()
    expect(page.locator("#plan-stale")).to_be_empty()
    expect(page.locator("#confirm-plan")).to_be_enabled()
    assert "csrfmiddlewaretoken" not in page.url
