"""Secrets at rest: encrypted, never rendered, never logged, never in the audit history; keys rotate."""

from __future__ import annotations

import logging
from html.parser import HTMLParser
from urllib.parse import urljoin, urlparse

import asyncssh
import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.urls import reverse

from audit.models import AuditEvent
from nodes.models import Credential
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db

PLANTED_PASSWORD = "planted-password-7Qx!9"


@pytest.fixture
def planted_key() -> str:
    key = asyncssh.generate_private_key("ssh-ed25519")
    return key.export_private_key().decode()


def _key_body(private_key: str) -> str:
    """A distinctive middle line of the PEM body: appears in any rendering of the key."""
    lines = [line for line in private_key.splitlines() if line and not line.startswith("-----")]
    return lines[len(lines) // 2]


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "hx-get") and value:
                self.links.append(value)


def crawl(client, start: str, limit: int = 200) -> dict[str, str]:
    """GET every same-site page reachable from `start` (no POSTs, no logout)."""
    seen: dict[str, str] = {}
    queue = [start]
    while queue and len(seen) < limit:
        url = queue.pop(0)
        path = urlparse(url).path
        if path in seen or path.startswith(("/static/", "/logout")) or "delete" in path:
            continue
        response = client.get(url)
        body = response.content.decode(errors="replace") if response.status_code == 200 else ""
        seen[path] = body
        parser = _Links()
        parser.feed(body)
        for link in parser.links:
            absolute = urljoin(url, link)
            if urlparse(absolute).netloc in ("", "testserver"):
                queue.append(urlparse(absolute).path)
    return seen


def test_planted_key_and_password_appear_on_no_page_no_log_and_no_audit_entry(
    admin_client, planted_key, caplog
):
    caplog.set_level(logging.DEBUG)
    admin_client.post(
        reverse("nodes:credential_create"),
        {"name": "with-key", "kind": "private_key", "secret": planted_key, "passphrase": ""},
    )
    admin_client.post(
        reverse("nodes:credential_create"),
        {"name": "with-password", "kind": "password", "secret": PLANTED_PASSWORD},
    )
    key_cred = Credential.objects.get(name="with-key")
    password_cred = Credential.objects.get(name="with-password")
    assert key_cred.secret() == planted_key.strip() + "\n" or key_cred.secret() == planted_key
    assert password_cred.secret() == PLANTED_PASSWORD
    # Encrypted at rest.
    assert PLANTED_PASSWORD not in password_cred.secret_encrypted
    assert _key_body(planted_key) not in key_cred.secret_encrypted
    NodeFactory(name="desk", credential=key_cred)
    # Re-saving the edit form with the placeholder keeps the stored secret.
    edit = admin_client.get(reverse("nodes:credential_edit", args=[password_cred.pk])).content.decode()
    assert PLANTED_PASSWORD not in edit and "stored; leave as is to keep" in edit

    pages = crawl(admin_client, reverse("dashboard"))
    pages.update(crawl(admin_client, reverse("admin:index")))
    pages[reverse("audit")] = admin_client.get(reverse("audit")).content.decode()
    assert len(pages) >= 8, sorted(pages)
    for path, body in pages.items():
        assert PLANTED_PASSWORD not in body, path
        assert _key_body(planted_key) not in body, path
    audit_text = " ".join(str(e.changes) for e in AuditEvent.objects.all())
    assert PLANTED_PASSWORD not in audit_text and _key_body(planted_key) not in audit_text
    assert AuditEvent.objects.filter(action="credential.create").count() == 2
    assert PLANTED_PASSWORD not in caplog.text and _key_body(planted_key) not in caplog.text


def test_editing_with_the_placeholder_keeps_the_stored_secret(admin_client):
    admin_client.post(
        reverse("nodes:credential_create"), {"name": "pw", "kind": "password", "secret": "first-pw"}
    )
    credential = Credential.objects.get(name="pw")
    page = admin_client.get(reverse("nodes:credential_edit", args=[credential.pk])).content.decode()
    placeholder = "•••••••• (stored; leave as is to keep)"
    assert placeholder in page
    admin_client.post(
        reverse("nodes:credential_edit", args=[credential.pk]),
        {"name": "pw-renamed", "kind": "password", "secret": placeholder},
    )
    credential.refresh_from_db()
    assert credential.name == "pw-renamed"
    assert credential.secret() == "first-pw"


@pytest.mark.parametrize(
    ("secret", "passphrase", "field", "message"),
    [
        (
            "-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n-----END OPENSSH PRIVATE KEY-----",
            "",
            "secret",
            "This is not a private key that can be read",
        ),
        ("ENCRYPTED", "", "passphrase", "This key is protected by a passphrase; enter it below."),
        ("ENCRYPTED", "wrong-passphrase", "passphrase", "The passphrase does not open this key."),
        ("", "", "secret", "Enter the password or paste the private key"),
    ],
)
def test_bad_keys_re_render_the_form_and_save_nothing(admin_client, secret, passphrase, field, message):
    if secret == "ENCRYPTED":
        key = asyncssh.generate_private_key("ssh-ed25519")
        secret = key.export_private_key(passphrase="the-right-one").decode()
    response = admin_client.post(
        reverse("nodes:credential_create"),
        {"name": "k", "kind": "private_key", "secret": secret, "passphrase": passphrase},
    )
    assert response.status_code == 200
    body = response.content.decode()
    assert message in body
    assert not Credential.objects.exists()
    if secret:
        # The submitted key is not echoed back into the re-rendered form.
        assert _key_body(secret) not in body
        assert "paste it again" in body


def test_passphrase_protected_key_with_its_passphrase_is_accepted(admin_client):
    key = asyncssh.generate_private_key("ssh-ed25519")
    secret = key.export_private_key(passphrase="the-right-one").decode()
    admin_client.post(
        reverse("nodes:credential_create"),
        {"name": "k", "kind": "private_key", "secret": secret, "passphrase": "the-right-one"},
    )
    credential = Credential.objects.get(name="k")
    assert credential.passphrase() == "the-right-one"
    assert credential.public_fingerprint == key.get_fingerprint("sha256")


def test_oversized_key_upload_is_refused(admin_client, settings):
    from django.core.files.uploadedfile import SimpleUploadedFile

    settings.RAMDECK_MAX_UPLOAD_BYTES = 2048
    upload = SimpleUploadedFile("id_ed25519", b"x" * 4096)
    response = admin_client.post(
        reverse("nodes:credential_create"), {"name": "big", "kind": "private_key", "key_file": upload}
    )
    assert response.status_code == 200
    assert "a key file is at most 2,048 bytes" in response.content.decode()
    assert not Credential.objects.exists()


def test_rotate_encryption_key_re_encrypts_with_the_newest_key(settings):
    old_key = settings.RAMDECK_ENCRYPTION_KEYS[0]
    credential = Credential(name="c", kind="password")
    credential.set_secret("rotate-me")
    credential.save()
    new_key = Fernet.generate_key().decode()
    settings.RAMDECK_ENCRYPTION_KEYS = [new_key, old_key]
    call_command("rotate_encryption_key")
    credential.refresh_from_db()
    settings.RAMDECK_ENCRYPTION_KEYS = [new_key]  # The old key can now be dropped.
    assert credential.secret() == "rotate-me"
    assert Fernet(new_key.encode()).decrypt(credential.secret_encrypted.encode()) == b"rotate-me"
