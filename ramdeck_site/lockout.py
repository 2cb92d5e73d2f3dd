"""Failed logins and lockouts (django-axes, configured in settings.py): two limits, and the way back.

- **Per address**: AXES_FAILURE_LIMIT failures from one client address within the cool-off lock that
  address, whatever usernames it tries (a guesser walking through accounts).
- **Per account**: RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT failures against one account, from any addresses,
  lock that account (a guesser spreading one account's guesses over many addresses).

Failures while locked out are refused without being counted (AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT
off), so a locked address cannot go on adding to an account's count: locking an account takes at least
account limit / address limit addresses, and every lock ends one cool-off after the failures that caused it.
An admin ends an account's lock at once on the Users page (`unlock`, audited), or on the console's host with
`manage.py axes_reset_username NAME`; `manage.py axes_reset_ip ADDRESS` frees an address.

Behind a reverse proxy the client address comes from X-Forwarded-For when the proxy is listed in
RAMDECK_TRUSTED_PROXIES (audit/history.py `client_ip`), so a lockout locks the client, not the proxy.

A username nobody has may be a password typed into the wrong box: axes stores it as a keyed hash
(`username_for_lockout`), so it still counts per "account" but its text is kept nowhere.
"""

from __future__ import annotations

from axes.attempts import get_cool_off_threshold
from axes.handlers.database import AxesDatabaseHandler
from axes.helpers import get_client_username, get_cool_off
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import Sum
from django.utils import timezone
from django.utils.crypto import salted_hmac

UNKNOWN_PREFIX = "unknown:"


def is_known_username(name: str | None) -> bool:
    if not name:
        return False
    user_model = get_user_model()
    return user_model._default_manager.filter(**{user_model.USERNAME_FIELD: name}).exists()


def username_for_lockout(request, credentials: dict | None = None) -> str | None:
    """What axes counts and stores as the username: the name itself when an account has it, else a keyed
    hash of what was typed (the same text gives the same hash, so an unknown name is limited like any
    other and an attacker cannot tell known from unknown names by the lockout)."""
    field = get_user_model().USERNAME_FIELD
    typed = credentials.get(field) if credentials else getattr(request, "POST", {}).get(field)
    if typed is None:
        return None
    typed = str(typed)
    if is_known_username(typed):
        return typed
    digest = salted_hmac("ramdeck.lockout.unknown-username", typed, algorithm="sha256").hexdigest()
    return UNKNOWN_PREFIX + digest[:24]


def _failures(attempts) -> int:
    return attempts.aggregate(n=Sum("failures_since_start"))["n"] or 0


class LockoutHandler(AxesDatabaseHandler):
    """Axes' database handler with a limit of its own for each of the two counts."""

    def get_failures(self, request, credentials: dict | None = None) -> int:
        """The failures that count against this request, on the per-address limit's scale (axes compares
        this number with AXES_FAILURE_LIMIT): the address's own, or the whole limit when the account's
        own limit is reached."""
        recent = AccessAttempt.objects.filter(attempt_time__gte=get_cool_off_threshold(request))
        by_address = _failures(recent.filter(ip_address=request.axes_ip_address))
        username = get_client_username(request, credentials)
        if username is not None:
            by_account = _failures(recent.filter(username=username))
            if by_account >= settings.RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT:
                return max(by_address, settings.AXES_FAILURE_LIMIT)
        return by_address

    def reset_user_attempts(self, request, credentials: dict | None = None) -> int:
        """After a successful login, forget that user's own failures from that address only: a login to
        one's own account must not wipe what an address did against other accounts, nor what other
        addresses did against this one."""
        username = get_client_username(request, credentials)
        own = AccessAttempt.objects.filter(username=username, ip_address=request.axes_ip_address)
        count, _ = own.delete()
        return count


def locked_usernames() -> set[str]:
    """Accounts locked now by their own limit (for the Users page)."""
    threshold = timezone.now() - get_cool_off()
    rows = (
        AccessAttempt.objects.filter(attempt_time__gte=threshold)
        .exclude(username__startswith=UNKNOWN_PREFIX)
        .values("username")
        .annotate(n=Sum("failures_since_start"))
        .filter(n__gte=settings.RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT)
    )
    return {row["username"] for row in rows}


def unlock(username: str) -> int:
    """Forget every failure against `username` (the same as `manage.py axes_reset_username`); how many
    records went."""
    count, _ = AccessAttempt.objects.filter(username=username).delete()
    return count
