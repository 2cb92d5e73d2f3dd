"""Login, logout, lockout and the audit history that records them; the history cannot be changed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from audit import history
from audit.models import AuditEvent
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db


def test_the_console_hashes_passwords_slowly_whatever_the_tests_use():
    # The suite swaps in MD5 for speed (tests/conftest.py); the console's own settings keep Django's
    # PBKDF2 first, which makes a stolen database's passwords expensive to guess.
    from django.conf import global_settings

    import ramdeck_site.settings as console

    hashers = getattr(console, "PASSWORD_HASHERS", global_settings.PASSWORD_HASHERS)
    assert hashers[0] == "django.contrib.auth.hashers.PBKDF2PasswordHasher"
    assert not any("MD5" in h or "Unsalted" in h for h in hashers)


def test_login_and_logout_are_audited_with_the_source_address(client):
    UserFactory(username="oscar", role="operator")
    response = client.post(
        reverse("login"), {"username": "oscar", "password": PASSWORD}, REMOTE_ADDR="192.0.2.7"
    )
    assert response.status_code == 302 and response.url == reverse("dashboard")
    client.post(reverse("logout"), REMOTE_ADDR="192.0.2.7")
    login, logout = AuditEvent.objects.order_by("pk")
    assert (login.action, login.actor_name, login.source_ip) == ("login", "oscar", "192.0.2.7")
    assert (logout.action, logout.actor_name) == ("logout", "oscar")


def test_failed_login_is_audited_without_the_password(client):
    UserFactory(username="oscar", role="operator")
    response = client.post(reverse("login"), {"username": "oscar", "password": "wrong-guess-123"})
    assert response.status_code == 200
    assert "Please enter a correct username and password" in response.content.decode()
    event = AuditEvent.objects.get(action="login.failed")
    assert event.object_repr == "oscar" and event.actor is None
    assert "wrong-guess-123" not in str(event.changes)


def test_repeated_failures_lock_the_account_even_for_the_right_password(client, settings):
    UserFactory(username="oscar", role="operator")
    for _ in range(settings.AXES_FAILURE_LIMIT):
        client.post(reverse("login"), {"username": "oscar", "password": "nope"})
    response = client.post(reverse("login"), {"username": "oscar", "password": PASSWORD})
    assert response.status_code == 429
    assert "Too many failed logins" in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_logout_needs_post(client, operator_user):
    client.force_login(operator_user)
    assert client.get(reverse("logout")).status_code == 405


def test_password_change_is_audited(client, operator_user):
    client.force_login(operator_user)
    response = client.post(
        reverse("password_change"),
        {
            "old_password": PASSWORD,
            "new_password1": "a-new-long-passphrase-9",
            "new_password2": "a-new-long-passphrase-9",
        },
    )
    assert response.status_code == 302
    assert AuditEvent.objects.filter(
        action="user.password_change", actor_name=operator_user.username
    ).exists()


def test_audit_events_cannot_be_changed_or_deleted(admin_user):
    event = history.record(admin_user, "node.create", object_type="node", object_repr="desk")
    event.action = "tampered"
    with pytest.raises(PermissionError):
        event.save()
    with pytest.raises(PermissionError):
        event.delete()
    with pytest.raises(PermissionError):
        AuditEvent.objects.filter(pk=event.pk).update(action="tampered")
    with pytest.raises(PermissionError):
        AuditEvent.objects.all().delete()
    assert AuditEvent.objects.get(pk=event.pk).action == "node.create"


def test_audit_admin_is_read_only(admin_client, admin_user):
    event = history.record(admin_user, "node.create", object_type="node", object_repr="desk")
    change_url = reverse("admin:audit_auditevent_change", args=[event.pk])
    assert admin_client.get(change_url).status_code == 200  # viewable
    assert admin_client.post(change_url, {"action": "x"}).status_code == 403
    assert (
        admin_client.post(
            reverse("admin:audit_auditevent_delete", args=[event.pk]), {"post": "yes"}
        ).status_code
        == 403
    )
    assert admin_client.get(reverse("admin:audit_auditevent_add")).status_code == 403


def test_secret_values_in_changes_are_redacted(admin_user):
    event = history.record(
        admin_user, "x.update", changes={"secret": ["a", "b"], "api_key": "k", "name": ["a", "b"]}
    )
    assert event.changes == {"secret": "•••", "api_key": "•••", "name": ["a", "b"]}


def test_audit_page_filters_by_actor_action_object_and_dates(viewer_client, admin_user, operator_user):
    history.record(admin_user, "node.create", object_type="node", object_repr="attic")
    # Append-only rows cannot be backdated later, so this one is written with an old time.
    backdated = AuditEvent(
        actor=admin_user,
        actor_name="alice-admin",
        action="node.delete",
        object_type="node",
        object_repr="cellar",
        at=timezone.now() - timedelta(days=10),
    )
    backdated.save()
    history.record(operator_user, "deployment.confirm", object_type="deployment", object_repr="llama-70b")
    url = reverse("audit")

    def rows(**params):
        return viewer_client.get(url, params).content.decode()

    assert "llama-70b" in rows(actor="oscar") and "attic" not in rows(actor="oscar")
    assert "attic" in rows(action="node.create") and "cellar" not in rows(action="node.create")
    assert "cellar" in rows(object="cellar") and "attic" not in rows(object="cellar")
    today = timezone.localdate().isoformat()
    recent = rows(since=today)
    assert "attic" in recent and "cellar" not in recent
    assert "The end date is before the start date." in rows(since=today, until="2020-01-01")


def test_audit_page_paginates(viewer_client, admin_user):
    for i in range(120):
        history.record(admin_user, "node.update", object_type="node", object_repr=f"node-{i:03}")
    first = viewer_client.get(reverse("audit")).content.decode()
    assert "Page 1 of 3" in first and "node-119" in first and "node-000" not in first
    last = viewer_client.get(reverse("audit"), {"page": 3}).content.decode()
    assert "node-000" in last


def test_admin_role_opens_user_management_and_operator_does_not(admin_client, client, operator_user):
    assert admin_client.get(reverse("admin:auth_user_changelist")).status_code == 200
    client.force_login(operator_user)
    assert client.get(reverse("admin:auth_user_changelist")).status_code == 302  # to the admin login


def test_a_user_without_a_role_gets_a_dashboard_that_says_so_and_shows_nothing(
    client, stranger_user, admin_user
):
    history.record(admin_user, "node.create", object_type="node", object_repr="secret-attic")
    client.force_login(stranger_user)
    body = client.get(reverse("dashboard")).content.decode()
    assert "Your account has no role yet" in body
    assert "secret-attic" not in body
