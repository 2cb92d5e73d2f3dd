"""The audit history: who did what, when, to which object. Append-only: no update, no delete, not even in
the admin. Site-wide (logins, nodes, jobs, deployments), so it is an app of its own at the bottom of the
import order (audit/history.py writes it)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from audit.sentences import details, sentence, what


class AuditEventQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise PermissionError("Audit events are append-only.")

    def delete(self):
        raise PermissionError("Audit events are append-only.")


class AuditEvent(models.Model):
    """One thing a person (or the console on their behalf) did. Append-only: no update, no delete."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)
    action = models.CharField(max_length=60, db_index=True)
    object_type = models.CharField(max_length=60, blank=True, db_index=True)
    object_id = models.CharField(max_length=60, blank=True)
    object_repr = models.CharField(max_length=200, blank=True)
    changes = models.JSONField(default=dict, blank=True)
    source_ip = models.GenericIPAddressField(null=True, blank=True)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [models.Index(fields=["object_type", "object_id"])]
        constraints = [models.CheckConstraint(condition=~Q(action=""), name="audit_action_not_empty")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name or 'system'} {self.action} {self.object_repr}"

    # As words for people (audit/sentences.py): "alice changed node box: name from — to box".
    @property
    def what(self) -> str:
        return what(self)

    @property
    def details(self) -> str:
        return details(self)

    @property
    def sentence(self) -> str:
        return sentence(self)

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            raise PermissionError("Audit events are append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise PermissionError("Audit events are append-only.")


class UnrecordedLoginFailures(models.Model):
    """How many failed logins with an unknown username were left out of the history since the last one that
    was written (ramdeck_site/login_audit.py writes at most one such entry per address per minute, and a
    few per minute in all, so a script guessing names cannot flood the history). One row; the next entry
    written carries the count, and it starts again from nought. A counter, not history: it changes."""

    count = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.count} failed logins not recorded one by one"
