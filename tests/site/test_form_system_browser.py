"""In a real browser: the builds and node forms show only the fields of the chosen source or transport,
with no script at all (CSS :has on the checked choice), and a bad git URL comes back as a form error."""

from __future__ import annotations

import pytest
from django.urls import reverse
from playwright.sync_api import expect

from jobs.models import Job
from nodes.models import Credential, Node, Transport
from tests.browser import log_in
from tests.factories import PASSWORD, NodeFactory, UserFactory

pytestmark = pytest.mark.browser


def test_the_builds_form_shows_only_the_chosen_sources_fields(live_server_url, page):
    UserFactory(username="olga-operator", role="operator")
    node = NodeFactory(name="old-pc")
    log_in(page, live_server_url, "olga-operator", PASSWORD)
    page.goto(live_server_url + reverse("builds:node", args=[node.name]))
    tarball, git_url, git_ref, path = (
        page.locator(f"[name={n}]") for n in ("tarball", "git_url", "git_ref", "path")
    )
    rebuild = page.locator("[name=rebuild]")
    expect(tarball).to_be_visible()
    expect(git_url).to_be_hidden()
    expect(path).to_be_hidden()
    page.check("input[name=source][value=git]")
    expect(git_url).to_be_visible()
    expect(git_ref).to_be_visible()
    expect(tarball).to_be_hidden()
    expect(path).to_be_hidden()
    page.check("input[name=source][value=existing]")
    expect(path).to_be_visible()
    expect(git_url).to_be_hidden()
    expect(rebuild).to_be_hidden()
    # A malformed git URL: the form again with the reason, git's fields shown, no job.
    page.check("input[name=source][value=git]")
    git_url.fill("not a url")
    page.click("#start-build")
    expect(page.locator("#field-git_url .errorlist")).to_contain_text("This is not a git URL")
    expect(git_url).to_be_visible()
    expect(git_url).to_have_value("not a url")
    assert not Job.objects.exists()


def test_the_node_form_hides_the_ssh_fields_for_a_local_node(live_server_url, page):
    UserFactory(username="ada-admin", role="admin")
    log_in(page, live_server_url, "ada-admin", PASSWORD)
    page.goto(live_server_url + reverse("nodes:create"))
    fields = [page.locator(f"[name={n}]") for n in ("address", "ssh_user", "ssh_port", "credential")]
    for field in fields:
        expect(field).to_be_visible()
    page.select_option("[name=transport]", Transport.LOCAL)
    for field in fields:
        expect(field).to_be_hidden()
    page.select_option("[name=transport]", Transport.SSH)
    for field in fields:
        expect(field).to_be_visible()
    # Local again and saved with the hidden fields untouched: the console's own host, no SSH needed.
    page.select_option("[name=transport]", Transport.LOCAL)
    page.fill("[name=name]", "this-box")
    page.click("#node-form button[type=submit]")
    page.wait_for_url("**/nodes/this-box/")
    node = Node.objects.get(name="this-box")
    assert node.is_local and node.address == "127.0.0.1"


def test_the_credential_form_shows_key_fields_for_a_key_only(live_server_url, page):
    UserFactory(username="ada-admin", role="admin")
    log_in(page, live_server_url, "ada-admin", PASSWORD)
    page.goto(live_server_url + reverse("nodes:credential_create"))
    secret, generate, key_file, passphrase = (
        page.locator(f"[name={n}]") for n in ("secret", "generate", "key_file", "passphrase")
    )
    page.select_option("[name=kind]", "password")
    expect(secret).to_be_visible()
    for field in (generate, key_file, passphrase):
        expect(field).to_be_hidden()
    page.select_option("[name=kind]", "private_key")
    for field in (secret, generate, key_file, passphrase):
        expect(field).to_be_visible()
    generate.check()  # the console makes the key: nothing to paste
    for field in (secret, key_file, passphrase):
        expect(field).to_be_hidden()
    page.fill("[name=name]", "made-here")
    page.click("#credential-form button[type=submit]")
    expect(page.locator("body")).to_contain_text("ssh-ed25519 ")
    assert Credential.objects.get(name="made-here").public_key.startswith("ssh-ed25519 ")
