"""Logins in the audit history (ramdeck_site/login_audit.py): Django admin's login door is recorded like the
console's own, an unknown username is never recorded as typed, and such failures cannot flood the history."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent, UnrecordedLoginFailures
from ramdeck_site import login_audit
from tests.factories import PASSWORD, UserFactory

pytestmark = [pytest.mark.security, pytest.mark.django_db]


@pytest.fixture(autouse=True)
def no_lockout(settings):
    """These tests send many failures from one address on purpose: the lockout is tested elsewhere."""
    settings.AXES_FAILURE_LIMIT = 10_000
    settings.RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT = 10_000


def post_login(url: str, username: str, password: str, address: str = "192.0.2.1") -> int:
    return Client().post(url, {"username": username, "password": password}, REMOTE_ADDR=address).status_code


@pytest.mark.parametrize("door", ["login", "admin:login"])
def test_both_login_doors_record_a_login_and_a_failure_with_the_source_address(door):
    UserFactory(username="alice", role="admin", is_staff=True)
    url = reverse(door)
    assert post_login(url, "alice", "not-her-password", "192.0.2.7") == 200
    assert post_login(url, "alice", PASSWORD, "192.0.2.8") == 302
    failed, login = AuditEvent.objects.order_by("pk")
    assert (failed.action, failed.object_repr, failed.source_ip, failed.actor) == (
        "login.failed",
        "alice",
        "192.0.2.7",
        None,
    )
    assert "not-her-password" not in str(failed.changes)
    assert (login.action, login.actor_name, login.source_ip) == ("login", "alice", "192.0.2.8")


@pytest.mark.parametrize("door", ["login", "admin:login"])
def test_an_unknown_username_is_recorded_without_what_was_typed(door):
    UserFactory(username="alice", role="admin")
    typed = "Tr0ub4dor&3-my-real-password"  # typed into the username box by mistake
    assert post_login(reverse(door), typed, "alice") == 200
    event = AuditEvent.objects.get(action="login.failed")
    stored = f"{event.object_repr} {event.changes} {event.sentence}"
    assert typed not in stored and str(len(typed)) not in stored
    assert event.sentence == "a login as an unknown username failed"


def test_unknown_username_failures_are_rate_limited_per_address_and_the_next_entry_counts_the_rest(
    monkeypatch,
):
    url = reverse("login")
    for i in range(25):
        post_login(url, f"guess-{i}", "x", "192.0.2.50")
    # One entry from that address in the minute; a known account's failure is still recorded each time.
    post_login(url, "nobody", "x", "192.0.2.50")
    UserFactory(username="vera", role="viewer")
    post_login(url, "vera", "x", "192.0.2.50")
    post_login(url, "vera", "x", "192.0.2.50")
    unknown = AuditEvent.objects.filter(action="login.failed", object_repr=login_audit.UNKNOWN)
    assert unknown.count() == 1
    assert AuditEvent.objects.filter(action="login.failed", object_repr="vera").count() == 2
    assert UnrecordedLoginFailures.objects.get().count == 25

    # A minute later the next one is written, and says how many were left out.
    from django.utils import timezone

    later = timezone.now() + login_audit.WINDOW
    monkeypatch.setattr(timezone, "now", lambda: later)
    post_login(url, "guess-again", "x", "192.0.2.50")
    latest = unknown.order_by("pk").last()
    assert latest.changes == {"username": login_audit.UNKNOWN, "not_recorded_before": 25}
    assert latest.sentence == (
        "a login as an unknown username failed "
        "(after 25 more with unknown usernames, not recorded one by one)"
    )
    assert UnrecordedLoginFailures.objects.get().count == 0


def test_unknown_username_failures_from_many_addresses_are_capped_per_minute():
    url = reverse("login")
    for i in range(3 * login_audit.UNKNOWN_PER_WINDOW):
        post_login(url, "guess", "x", f"2001:db8::{i + 1:x}")
    unknown = AuditEvent.objects.filter(action="login.failed", object_repr=login_audit.UNKNOWN)
    assert unknown.count() == login_audit.UNKNOWN_PER_WINDOW
    assert UnrecordedLoginFailures.objects.get().count == 2 * login_audit.UNKNOWN_PER_WINDOW
