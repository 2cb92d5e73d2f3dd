"""The Add-a-node form has no dead end: where it asks for a credential it offers to create one, and comes
back with what was typed and the new credential chosen. An SSH node is probed as soon as it is added."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs.models import Job, JobState
from nodes.models import Credential, Node, Transport
from tests.factories import CredentialFactory

pytestmark = pytest.mark.django_db

TYPED = {
    "name": "pc2",
    "address": "192.0.2.22",
    "transport": "ssh",
    "ssh_port": "2222",
    "ssh_user": "family",
    "rpc_port": "50052",
    "rpc_bind_address": "",
    "rpc_tunnel": "on",
    "platform_hint": "auto",
    "notes": "the kids' computer",
    "enabled": "on",
}


@pytest.fixture
def sent(monkeypatch):
    """Jobs sent to a worker (none really is)."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: calls.append((job.kind, job.node_id)) or True)
    return calls


def test_a_missing_credential_is_an_error_next_to_a_way_to_create_one(admin_client):
    response = admin_client.post(reverse("nodes:create"), TYPED)
    assert response.status_code == 200 and not Node.objects.exists()
    page = response.content.decode()
    assert "An SSH node needs a credential" in page
    link = f'href="{reverse("nodes:credential_create")}?next={reverse("nodes:create").replace("/", "%2F")}"'
    assert f'<a {link} id="create-credential">Create a credential</a>' in page
    assert "No credential yet." in page


def test_creating_a_credential_from_the_node_form_comes_back_with_what_was_typed(
    admin_client, sent, django_capture_on_commit_callbacks
):
    # "Create a credential": nothing is saved, the typed values are kept, the credential form opens.
    response = admin_client.post(reverse("nodes:create"), {**TYPED, "then": "credential"})
    assert not Node.objects.exists()
    next_url = reverse("nodes:create")
    assert response.status_code == 302
    assert response.url == f"{reverse('nodes:credential_create')}?next={next_url.replace('/', '%2F')}"
    assert "csrfmiddlewaretoken" not in response.url and "pc2" not in response.url
    form_page = admin_client.get(response.url).content.decode()
    assert f'<input type="hidden" name="next" value="{next_url}">' in form_page
    assert 'id="credential-for-node"' in form_page

    response = admin_client.post(
        response.url,
        {"name": "family password", "kind": "password", "secret": "hunter22", "next": next_url},
    )
    credential = Credential.objects.get(name="family password")
    assert response.status_code == 302 and response.url == f"{next_url}?credential={credential.pk}"

    # Back on the form: what was typed, and the new credential chosen.
    page = admin_client.get(response.url).content.decode()
    assert 'value="pc2"' in page and 'value="192.0.2.22"' in page and 'value="2222"' in page
    assert "the kids&#x27; computer" in page
    assert f'<option value="{credential.pk}" selected>' in page

    # Added: probed at once, the probe job queued once the node's row committed.
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(reverse("nodes:create"), {**TYPED, "credential": credential.pk})
    node = Node.objects.get(name="pc2")
    assert response.status_code == 302 and response.url == node.get_absolute_url()
    probe = Job.objects.get(kind="probe", node=node)
    assert probe.state == JobState.QUEUED and sent == [("probe", node.pk)]
    assert AuditEvent.objects.filter(action="node.probe", object_id=str(node.pk)).exists()
    node_page = admin_client.get(node.get_absolute_url()).content.decode()
    assert probe.get_absolute_url() in node_page and "probing its hardware now" in node_page


def test_the_credential_form_returns_only_to_the_node_form(admin_client):
    response = admin_client.post(
        f"{reverse('nodes:credential_create')}?next=https://elsewhere.example/",
        {"name": "x", "kind": "password", "secret": "hunter22", "next": "https://elsewhere.example/"},
    )
    assert response.status_code == 302 and response.url == reverse("nodes:credentials")


def test_a_local_node_and_a_disabled_one_are_not_probed_on_adding(admin_client, sent):
    credential = CredentialFactory()
    admin_client.post(reverse("nodes:create"), {**TYPED, "credential": credential.pk, "enabled": ""})
    assert Node.objects.get(name="pc2").enabled is False
    admin_client.post(reverse("nodes:create"), {**TYPED, "name": "here", "transport": "local"})
    assert Node.objects.get(name="here").transport == Transport.LOCAL
    assert not Job.objects.exists()


@pytest.mark.browser
def test_in_a_browser_the_node_form_sends_for_a_credential_and_comes_back_with_it(
    live_server_url, page, sent
):
    from tests.browser import log_in
    from tests.factories import PASSWORD, UserFactory

    UserFactory(username="ada-admin", role="admin")
    log_in(page, live_server_url, "ada-admin", PASSWORD)
    page.goto(live_server_url + reverse("nodes:create"))
    page.fill("[name=name]", "pc2")
    page.fill("[name=address]", "192.0.2.22")
    page.fill("[name=ssh_user]", "family")
    page.click("#create-credential")
    page.wait_for_url(f"**{reverse('nodes:credential_create')}?next=*")
    expect_text = page.locator("#credential-for-node").inner_text()
    assert "back to the node you were adding" in expect_text
    page.fill("[name=name]", "family password")
    page.select_option("[name=kind]", "password")
    page.fill("[name=secret]", "hunter22")
    page.click("#credential-form button[type=submit]")
    page.wait_for_url(f"**{reverse('nodes:create')}?credential=*")
    credential = Credential.objects.get(name="family password")
    assert page.input_value("[name=name]") == "pc2" and page.input_value("[name=ssh_user]") == "family"
    assert page.input_value("[name=credential]") == str(credential.pk)
    page.press("[name=address]", "Enter")  # Enter adds the node (the link is no submit button)
    page.wait_for_url("**/nodes/pc2/")
    node = Node.objects.get(name="pc2")
    assert node.credential == credential
    probe = Job.objects.get(kind="probe", node=node)
    assert page.locator(f'#node-jobs a[href="{probe.get_absolute_url()}"]').count() == 1
