"""Write audit history entries. Called explicitly next to every change; never from signals.

`record` accepts a request (for the actor and source IP) or an explicit actor, so Celery workers, which
have no request, audit with the user who started the job.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from typing import Any

from django.conf import settings
from django.db import models

from audit.models import AuditEvent
from remote.text import printable, printable_json

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
    """The address of the person behind `request`: the peer's, or behind a trusted reverse proxy
    (RAMDECK_TRUSTED_PROXIES) the one the proxies name in X-Forwarded-For.

    The header is read from the right: each proxy appends the address it got the request from, so the
    rightmost entry that is not one of our proxies is the client; whatever a client wrote into the header
    itself stands further left and is never reached. From a peer that is not a trusted proxy the header is
    ignored (anyone can send one). The login lockout (AXES_CLIENT_IP_CALLABLE) asks the same question, so a
    lockout behind the proxy locks the client, not the proxy and everyone behind it.
    """
    if request is None:
        return None
    peer = _address(request.META.get("REMOTE_ADDR"))
    trusted = _networks(tuple(getattr(settings, "RAMDECK_TRUSTED_PROXIES", ())))
    if peer is None or not trusted or not _is_in(peer, trusted):
        return str(peer) if peer is not None else None
    client = peer
    for entry in reversed(request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")):
        hop = _address(entry)
        if hop is None:
            break  # a malformed entry: nothing left of it can be trusted; the last good hop is the client
        client = hop
        if not _is_in(hop, trusted):
            break
    return str(client)


def _address(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address((text or "").strip())
    except ValueError:
        return None
    # An IPv4 client seen through an IPv6 socket (::ffff:192.0.2.7) is that IPv4 client.
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


@functools.cache
def _networks(items: tuple[str, ...]) -> tuple:
    return tuple(ipaddress.ip_network(item, strict=False) for item in items)


def _is_in(address, networks: tuple) -> bool:
    return any(address.version == net.version and address in net for net in networks)


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
        # only, as everywhere such text is stored (remote/text.py).
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
