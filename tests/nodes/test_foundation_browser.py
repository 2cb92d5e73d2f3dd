"""What a new user does first, in a real browser: log in, add a credential and a node, edit it, fail
validation once, delete it with confirmation, and find all of it in the audit history."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from audit.models import AuditEvent
from nodes.models import Credential, Node
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.browser


def test_new_admin_manages_a_node_and_finds_it_all_in_the_audit_history(live_server_url, page):
    UserFactory(username="alice-admin", role="admin")
    log_in(page, live_server_url, "alice-admin", PASSWORD)

    # A credential first: a password, which is never shown again.
    page.click("text=Nodes")
    page.click("text=Credentials")
    page.click("#add-credential")
    page.fill("input[name=name]", "household-root")
    page.select_option("select[name=kind]", "password")
    page.fill("textarea[name=secret]", "s3cret-household-pw")
    page.click("text=Save credential")
    expect(page.locator(".message.success")).to_contain_text("Credential household-root saved.")
    expect(page.locator("body")).not_to_contain_text("s3cret-household-pw")

    # A node, with one validation failure on the way.
    page.goto(f"{live_server_url}/nodes/")
    page.click("#add-node")
    page.fill("input[name=name]", "attic-pc")
    page.fill("input[name=address]", "attic pc!")
    page.fill("input[name=ssh_user]", "ramdeck")
    page.select_option("select[name=credential]", label="household-root")
    page.click("text=Add node")
    expect(page.locator("#field-address .errorlist")).to_contain_text("is not a valid hostname or IP address")
    assert not Node.objects.exists()
    page.fill("input[name=address]", "192.0.2.40")
    page.click("text=Add node")
    expect(page.locator("h1")).to_contain_text("attic-pc")

    # Edit it.
    page.click("text=Edit")
    page.fill("input[name=address]", "192.0.2.41")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.locator(".message.success")).to_contain_text("Node attic-pc saved.")
    expect(page.locator("dd.mono").first).to_have_text("192.0.2.41")

    # Delete it from the list, confirming the dialog; the row goes without a reload.
    page.goto(f"{live_server_url}/nodes/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#node-table tr", has_text="attic-pc").locator("text=Delete").click()
    expect(page.locator("#node-table")).not_to_contain_text("attic-pc")
    assert not Node.objects.filter(name="attic-pc").exists()

    # Everything is in the audit history.
    page.click("text=Audit")
    table = page.locator("#audit-table")
    for action in ("login", "credential.create", "node.create", "node.update", "node.delete"):
        expect(table).to_contain_text(action)
    page.fill("input[name=action]", "node.update")
    expect(table).not_to_contain_text("credential.create")
    expect(table).to_contain_text("192.0.2.41")


def test_declining_the_delete_dialog_keeps_the_node(live_server_url, page):
    UserFactory(username="alice-admin", role="admin")
    Node.objects.create(name="desk", address="192.0.2.10", transport="local")
    log_in(page, live_server_url, "alice-admin", PASSWORD)
    page.goto(f"{live_server_url}/nodes/")
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.locator("#node-table tr", has_text="desk").locator("text=Delete").click()
    page.wait_for_timeout(500)
    expect(page.locator("#node-table")).to_contain_text("desk")
    assert Node.objects.filter(name="desk").exists()


def test_viewer_sees_no_add_button_and_cannot_post_the_form(live_server_url, page):
    UserFactory(username="vera-viewer", role="viewer")
    Credential.objects.create(name="c", kind="password", secret_encrypted="")
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/nodes/")
    expect(page.locator("#add-node")).to_have_count(0)
    # Posting the form directly (with a valid CSRF token from the page) is refused.
    token = page.locator("body").get_attribute("hx-headers")
    csrf = re.search(r'"X-CSRFToken": "([^"]+)"', token).group(1)
    response = page.request.post(
        f"{live_server_url}/nodes/new/",
        form={
            "name": "sneaky",
            "address": "192.0.2.9",
            "transport": "local",
            "ssh_port": "22",
            "rpc_port": "50052",
            "platform_hint": "auto",
        },
        headers={"X-CSRFToken": csrf, "Referer": f"{live_server_url}/nodes/"},
    )
    assert response.status == 403
    assert not Node.objects.filter(name="sneaky").exists()
    assert AuditEvent.objects.filter(action="permission_denied", actor_name="vera-viewer").exists()
