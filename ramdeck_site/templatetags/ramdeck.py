"""Template filters used across apps."""

from __future__ import annotations

from django import template

register = template.Library()

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@register.filter
def bytes(value) -> str:  # noqa: A001 - reads naturally in templates: {{ n|bytes }}
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
