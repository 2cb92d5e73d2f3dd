"""Write audit history entries. Called explicitly next to every change; never from signals.

`record` accepts a request (for the actor and source IP) or an explicit actor, so Celery workers, which
have no request, audit with the user who started the job.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import models

from ramdeck_site.printable import printable, printable_json

from .models import AuditEvent

REDACTED = "•••"
# A string in a change set is cut to this (a node's notes, a reason: long enough for what people write).
CHANGE_TEXT_LIMIT = 4000
# Keys whose values are secret wherever they appear in a change set.
# "token" but not "tokens_per_s" (a speed, which an audit entry of a confirmed plan should show).
_SECRET_KEY_PATTERN = re.compile(
    r"secret|password|passphrase|private|api_key|token(?!s_per)|key_material", re.I
)


def redact(value: Any) -> Any:
    """A copy of `value` with every secret-looking key's value replaced by a marker."""
    if isinstance(value, dict):
        return {
            key: (REDACTED if _SECRET_KEY_PATTERN.search(str(key)) and val not in (None, "") else redact(val))
            for key, val in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item) for item in value]
    return value


def client_ip(request) -> str | None:
    if request is None:
        return None
    return request.META.get("REMOTE_ADDR") or None


def record(
    request_or_actor,
    action: str,
    obj: models.Model | None = None,
    *,
    changes: dict | None = None,
    object_type: str = "",
    object_repr: str = "",
    actor_name: str = "",
) -> AuditEvent:
    request = request_or_actor if hasattr(request_or_actor, "META") else None
    actor = getattr(request, "user", None) if request is not None else request_or_actor
    if actor is not None and not getattr(actor, "is_authenticated", False):
        actor = None
    if obj is not None:
        object_type = object_type or obj._meta.model_name
        object_repr = object_repr or str(obj)
    return AuditEvent.objects.create(
        actor=actor,
        actor_name=actor_name or (actor.get_username() if actor is not None else ""),
        action=action,
        object_type=object_type,
        object_id=str(obj.pk) if obj is not None and obj.pk is not None else "",
        # Names and changes may quote what a node or a model file said (a reason, a model's name): printable
        # only, as everywhere such text is stored (ramdeck_site/printable.py).
        object_repr=printable(object_repr, 200),
        changes=printable_json(redact(changes or {}), CHANGE_TEXT_LIMIT, lines=True),
        source_ip=client_ip(request),
    )


def form_changes(form) -> dict:
    """What a bound, valid ModelForm changed: {field: [old, new]}, secrets redacted by `record`."""
    result = {}
    for name in form.changed_data:
        old = form.initial.get(name)
        new = form.cleaned_data.get(name)
        result[name] = [_plain(old), _plain(new)]
    return result


def _plain(value: Any) -> Any:
    if isinstance(value, models.Model):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
