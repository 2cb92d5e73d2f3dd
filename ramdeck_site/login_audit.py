"""Logins in the audit history, the same for the console's login page and for Django admin's.

A success is recorded with the user. A failure with a username somebody has is recorded with that name. A
failure with a username nobody has is recorded as "an unknown username", never with what was typed (people
type their password into the username box), and such entries are rate-limited: at most one per source
address per minute and UNKNOWN_PER_WINDOW per minute from all addresses, so a script guessing names cannot
flood the history. The failures left out are counted (audit.models.UnrecordedLoginFailures) and the next
entry written says how many there were.
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.views import LoginView
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from audit import history
from audit.models import AuditEvent, UnrecordedLoginFailures
from ramdeck_site.lockout import is_known_username

UNKNOWN = "an unknown username"
WINDOW = timedelta(minutes=1)
UNKNOWN_PER_WINDOW = 10


def record_success(request, user) -> None:
    history.record(request, "login", user)


def record_failure(request, typed: str | None) -> AuditEvent | None:
    """Record a failed login; the entry, or None when it was counted instead (rate-limited)."""
    typed = (typed or "")[:150]
    if is_known_username(typed):
        return history.record(
            request, "login.failed", object_type="user", object_repr=typed, changes={"username": typed}
        )
    return _record_unknown(request)


def _record_unknown(request) -> AuditEvent | None:
    source = history.client_ip(request)
    with transaction.atomic():
        # The counter's row is locked first, so concurrent failures decide one after another.
        tally, _ = UnrecordedLoginFailures.objects.select_for_update().get_or_create(pk=1)
        recent = AuditEvent.objects.filter(
            action="login.failed", object_repr=UNKNOWN, at__gte=timezone.now() - WINDOW
        )
        if recent.filter(source_ip=source).exists() or recent.count() >= UNKNOWN_PER_WINDOW:
            UnrecordedLoginFailures.objects.filter(pk=tally.pk).update(count=F("count") + 1)
            return None
        changes: dict = {"username": UNKNOWN}
        if tally.count:
            changes["not_recorded_before"] = tally.count
            UnrecordedLoginFailures.objects.filter(pk=tally.pk).update(count=0)
        return history.record(
            request, "login.failed", object_type="user", object_repr=UNKNOWN, changes=changes
        )


class AuditedLoginMixin:
    """For django.contrib.auth LoginView subclasses: every success and failure goes into the history."""

    def form_valid(self, form):
        response = super().form_valid(form)
        record_success(self.request, self.request.user)
        return response

    def form_invalid(self, form):
        record_failure(self.request, self.request.POST.get("username"))
        return super().form_invalid(form)


class AuditedAdminLoginView(AuditedLoginMixin, LoginView):
    """Django admin's login view (ramdeck_site/admin_site.py), recording as the console's own login does."""
