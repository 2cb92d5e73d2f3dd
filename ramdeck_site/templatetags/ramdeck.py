"""Template filters used across apps."""

from __future__ import annotations

import ipaddress

from django import template

from ramdeck_site import roles

register = template.Library()

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@register.filter
def bytes(value) -> str:
    """1536 -> '1.5 KiB'. Binary units, as llama.cpp and the OS report memory."""
    try:
        amount = float(value)
    except (TypeError, ValueError):
        return ""
    unit = 0
    while abs(amount) >= 1024 and unit < len(_UNITS) - 1:
        amount /= 1024
        unit += 1
    return f"{amount:.0f} {_UNITS[unit]}" if unit == 0 else f"{amount:.1f} {_UNITS[unit]}"


@register.filter
def may(user, what) -> bool:
    """`{% if user|may:"deployments:stop" %}`: the one question a template asks before it shows a button, a
    form or a link to an action (ramdeck_site/roles.py `may_use`). Given an object instead of a route name
    (`{% if user|may:job %}`), whether its page opens for the user, as the object itself says
    (`may_be_opened_by`: a job's log on the console's own host is the admins'). Pages rendered outside a
    request (the websocket re-renders) put `user` in their context."""
    if not user:
        return False
    if isinstance(what, str):
        return roles.may_use(user, what)
    return what.may_be_opened_by(user)


@register.filter
def percent(value) -> str:
    try:
        return f"{float(value) * 100:.0f}%"
    except (TypeError, ValueError):
        return ""


@register.filter
def signed_percent(value) -> str:
    """-0.54 -> "-54%", 0.1 -> "+10%" (a difference, so its sign matters)."""
    try:
        return f"{float(value) * 100:+.0f}%"
    except (TypeError, ValueError):
        return ""


@register.filter
def pct_of(part, whole) -> float:
    """Width percentage for bars, clamped to 0..100."""
    try:
        whole = float(whole)
        return 0.0 if whole <= 0 else max(0.0, min(100.0, float(part) * 100.0 / whole))
    except (TypeError, ValueError):
        return 0.0


def _loopback(address: str | None) -> bool:
    try:
        return ipaddress.ip_address((address or "").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@register.inclusion_tag("includes/plain_http_warning.html", takes_context=True)
def plain_http_warning(context, what: str = "this secret") -> dict:
    """A warning above a form that takes a password or a key, when the page came over plain HTTP to another
    machine: whoever shares the network (a guest's phone, a smart TV) can read what is sent. Behind a TLS
    proxy (RAMDECK_TRUST_PROXY_HEADER) or on the console's own host there is nothing to say."""
    request = context.get("request")
    if request is None:
        return {"exposed": False, "what": what}
    exposed = not request.is_secure() and not _loopback(request.META.get("REMOTE_ADDR"))
    return {"exposed": exposed, "what": what}


@register.filter
def nav_section(match) -> str:
    """The top bar's section of a page: its app's namespace, else its URL name; "" when no route matched
    (a 404 for an unknown address has no `resolver_match`, and the page must still render)."""
    if match is None:
        return ""
    return match.app_name or match.url_name or ""
