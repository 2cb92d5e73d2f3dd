"""Failed logins (ramdeck_site/lockout.py, django-axes): a limit per address and one per account, the way back
for a locked account, and the client's address behind a trusted reverse proxy (audit/history.py
`client_ip`, which the lockout and the audit history both use)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.core.management import call_command
from django.db.models import F
from django.test import RequestFactory
from django.urls import reverse

from audit import history
from audit.models import AuditEvent
from tests.factories import PASSWORD, UserFactory
from tests.paths import ROOT

pytestmark = [pytest.mark.security, pytest.mark.django_db]

LOCKED = 429


@pytest.fixture
def limits(settings):
    """Small limits, so each test is quick to read: 3 failures lock an address, 6 lock an account."""
    settings.AXES_FAILURE_LIMIT = 3
    settings.RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT = 6
    return settings


@pytest.fixture
def people(db):
    return {
        "oscar": UserFactory(username="oscar", role="operator"),
        "vera": UserFactory(username="vera", role="viewer"),
        "alice": UserFactory(username="alice", role="admin"),
    }


def attempt(client, username: str, password: str = "wrong-guess", **meta) -> int:
    """One login attempt from a fresh browser; its status (302 in, 200 refused, 429 locked out)."""
    client.cookies.clear()
    meta.setdefault("REMOTE_ADDR", "192.0.2.1")
    response = client.post(reverse("login"), {"username": username, "password": password}, **meta)
    return response.status_code


def failures_against(username: str) -> int:
    return sum(AccessAttempt.objects.filter(username=username).values_list("failures_since_start", flat=True))


# --------------------------------------------------------------------------------------------------
# Two limits


def test_failures_from_one_address_lock_that_address_whatever_usernames_it_tries(client, limits, people):
    assert attempt(client, "oscar", REMOTE_ADDR="192.0.2.1") == 200
    assert attempt(client, "vera", REMOTE_ADDR="192.0.2.1") == 200
    assert attempt(client, "nobody-here", REMOTE_ADDR="192.0.2.1") == LOCKED  # the third failure locks
    # The address is locked, even for another account's right password...
    assert attempt(client, "alice", PASSWORD, REMOTE_ADDR="192.0.2.1") == LOCKED
    # ...and no account is: the same people log in from elsewhere.
    for name in ("oscar", "vera", "alice"):
        assert attempt(client, name, PASSWORD, REMOTE_ADDR="192.0.2.2") == 302


def test_failures_against_one_account_from_many_addresses_lock_that_account_everywhere(
    client, limits, people
):
    for address in ("198.51.100.1", "198.51.100.2", "198.51.100.3"):
        for _ in range(2):  # under the address limit at each address
            answer = attempt(client, "oscar", REMOTE_ADDR=address)
    assert answer == LOCKED  # the sixth failure against oscar locks his account
    # It is locked from an address that never failed too.
    assert attempt(client, "oscar", PASSWORD, REMOTE_ADDR="203.0.113.9") == LOCKED
    # Other accounts are not, not even from the addresses that guessed.
    assert attempt(client, "vera", PASSWORD, REMOTE_ADDR="198.51.100.1") == 302


def test_a_locked_address_adds_nothing_to_an_accounts_count(client, limits, people):
    """Failures while locked out are refused without being counted: one address cannot lock an account by
    going on after its own lock, so locking an account takes several addresses."""
    for _ in range(3 + 20):
        attempt(client, "oscar", REMOTE_ADDR="192.0.2.66")
    assert failures_against("oscar") == 3
    assert attempt(client, "oscar", PASSWORD, REMOTE_ADDR="192.0.2.7") == 302


def test_a_lock_ends_one_cool_off_after_the_failures_that_caused_it(client, limits, people):
    for address in ("198.51.100.1", "198.51.100.2", "198.51.100.3"):
        for _ in range(2):
            attempt(client, "oscar", REMOTE_ADDR=address)
    for _ in range(10):  # tries during the lock do not make it longer
        assert attempt(client, "oscar", REMOTE_ADDR="198.51.100.4") == LOCKED
    assert failures_against("oscar") == 6
    # The cool-off passes (the recorded failures age; the table is axes' own, not the audit history).
    older = limits.AXES_COOLOFF_TIME + timedelta(seconds=1)
    AccessAttempt.objects.update(attempt_time=F("attempt_time") - older)
    assert attempt(client, "oscar", PASSWORD, REMOTE_ADDR="203.0.113.9") == 302


def test_a_login_forgets_only_that_users_own_failures_from_that_address(client, limits, people):
    attempt(client, "vera", REMOTE_ADDR="192.0.2.5")
    attempt(client, "oscar", REMOTE_ADDR="192.0.2.5")
    attempt(client, "oscar", REMOTE_ADDR="192.0.2.6")
    assert attempt(client, "oscar", PASSWORD, REMOTE_ADDR="192.0.2.5") == 302
    # What this address did against vera, and what another address did against oscar, still count.
    assert failures_against("vera") == 1 and failures_against("oscar") == 1
    assert AccessAttempt.objects.filter(username="oscar", ip_address="192.0.2.6").exists()


def test_an_unknown_username_is_counted_but_never_stored_as_typed(client, limits, people):
    typed = "correct-horse-battery-staple"  # a password typed into the username box
    for _ in range(2):
        assert attempt(client, typed, REMOTE_ADDR="192.0.2.8") == 200
    stored = list(AccessAttempt.objects.values_list("username", "post_data", "get_data"))
    assert stored and typed not in str(stored)
    assert failures_against(stored[0][0]) == 2  # the same text is the same (hashed) name each time


# --------------------------------------------------------------------------------------------------
# The way back


def lock_out(client, username: str) -> None:
    for address in ("198.51.100.1", "198.51.100.2", "198.51.100.3"):
        for _ in range(2):
            attempt(client, username, REMOTE_ADDR=address)
    assert attempt(client, username, PASSWORD, REMOTE_ADDR="203.0.113.9") == LOCKED


def test_an_admin_unlocks_a_locked_account_on_the_users_page_and_it_is_audited(client, limits, people):
    from django.test import Client

    lock_out(client, "oscar")
    admin = Client()
    admin.force_login(people["alice"])
    page = admin.get(reverse("users:list")).content.decode()
    oscar = people["oscar"]
    assert f'id="locked-{oscar.pk}"' in page and f'id="unlock-{oscar.pk}"' in page
    assert f'id="locked-{people["vera"].pk}"' not in page

    response = admin.post(reverse("users:unlock", args=[oscar.pk]))
    assert response.status_code == 302
    event = AuditEvent.objects.get(action="user.unlock")
    assert event.sentence.startswith("alice unlocked user oscar after failed logins")
    assert attempt(client, "oscar", PASSWORD, REMOTE_ADDR="203.0.113.9") == 302


def test_only_admins_may_unlock(client, limits, people):
    lock_out(client, "vera")
    client.force_login(people["oscar"])
    assert client.post(reverse("users:unlock", args=[people["vera"].pk])).status_code == 403
    assert failures_against("vera") == 6


def test_the_last_admin_locked_out_gets_back_in_with_axes_reset_username_on_the_console_host(
    client, limits, people, capsys
):
    """Someone on the LAN locks the only admin out: the documented way back (SECURITY.md, README) is a
    command on the console's host."""
    lock_out(client, "alice")
    call_command("axes_reset_username", "alice")
    assert "attempts removed" in capsys.readouterr().out
    assert attempt(client, "alice", PASSWORD, REMOTE_ADDR="203.0.113.9") == 302


# --------------------------------------------------------------------------------------------------
# Behind a reverse proxy


def address_of(**meta) -> str | None:
    return history.client_ip(RequestFactory().get("/", **meta))


def test_behind_a_trusted_proxy_each_client_is_locked_and_audited_by_its_own_address(client, limits, people):
    limits.RAMDECK_TRUSTED_PROXIES = ["127.0.0.1/32"]
    proxy = {"REMOTE_ADDR": "127.0.0.1"}
    assert [attempt(client, "vera", HTTP_X_FORWARDED_FOR="203.0.113.5", **proxy) for _ in range(3)] == [
        200,
        200,
        LOCKED,
    ]
    assert attempt(client, "oscar", PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.5", **proxy) == LOCKED
    # Everyone else behind the same proxy still gets in, and the history names their own address.
    assert attempt(client, "oscar", PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.6", **proxy) == 302
    login = AuditEvent.objects.get(action="login")
    assert login.source_ip == "203.0.113.6"
    failed = AuditEvent.objects.filter(action="login.failed").values_list("source_ip", flat=True)
    assert set(failed) == {"203.0.113.5"}
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {"203.0.113.5"}


def test_without_a_trusted_proxy_the_header_is_ignored(client, limits, people):
    limits.RAMDECK_TRUSTED_PROXIES = []
    for i in range(3):
        attempt(client, "vera", REMOTE_ADDR="192.0.2.9", HTTP_X_FORWARDED_FOR=f"203.0.113.{i}")
    # A guesser cannot escape its lock by writing a new address into the header each time.
    forged = {"REMOTE_ADDR": "192.0.2.9", "HTTP_X_FORWARDED_FOR": "203.0.113.77"}
    assert attempt(client, "vera", PASSWORD, **forged) == LOCKED
    assert set(AuditEvent.objects.values_list("source_ip", flat=True)) == {"192.0.2.9"}


def test_the_client_address_is_the_rightmost_one_no_trusted_proxy_added(settings):
    settings.RAMDECK_TRUSTED_PROXIES = ["127.0.0.1/32", "10.0.0.0/8"]
    # Caddy or nginx on the console's host: the client it saw.
    assert address_of(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="198.51.100.7") == "198.51.100.7"
    # A client that wrote its own header: the proxy appended the real address, which wins.
    forged = "203.0.113.66, 198.51.100.7"
    assert address_of(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR=forged) == "198.51.100.7"
    # Two proxies of ours in a row (10.0.0.2 in front of the local one): the client before them.
    chain = "203.0.113.66, 198.51.100.7, 10.0.0.2"
    assert address_of(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR=chain) == "198.51.100.7"
    # A malformed entry ends the walk: the last good hop is taken, never what stands left of the junk.
    assert address_of(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="1.2.3.4, junk, 10.0.0.2") == "10.0.0.2"
    # No header: the proxy itself. From anyone else the header means nothing.
    assert address_of(REMOTE_ADDR="127.0.0.1") == "127.0.0.1"
    assert address_of(REMOTE_ADDR="192.0.2.1", HTTP_X_FORWARDED_FOR="198.51.100.7") == "192.0.2.1"
    # An IPv4 client seen through an IPv6 socket is that IPv4 client.
    assert address_of(REMOTE_ADDR="::ffff:127.0.0.1", HTTP_X_FORWARDED_FOR="198.51.100.7") == "198.51.100.7"


def _settings_of(tmp_path, **env) -> subprocess.CompletedProcess:
    script = "from django.conf import settings as s; print('proxies', s.RAMDECK_TRUSTED_PROXIES)"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAMDECK_TRUST")}
    return subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", script],
        cwd=ROOT,
        env={**clean, "RAMDECK_VAR_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_documented_proxy_setup_trusts_loopback_and_nothing_else_does(tmp_path):
    assert "proxies []" in _settings_of(tmp_path).stdout
    behind = _settings_of(tmp_path, RAMDECK_TRUST_PROXY_HEADER="1")
    assert "proxies ['127.0.0.1/32', '::1/128']" in behind.stdout
    own = _settings_of(tmp_path, RAMDECK_TRUST_PROXY_HEADER="1", RAMDECK_TRUSTED_PROXIES="192.168.1.2")
    assert "proxies ['192.168.1.2/32']" in own.stdout
    wrong = _settings_of(tmp_path, RAMDECK_TRUSTED_PROXIES="192.168.1.2,proxy.lan")
    assert wrong.returncode != 0
    assert "RAMDECK_TRUSTED_PROXIES: 'proxy.lan' is not an IP address or network" in wrong.stderr
