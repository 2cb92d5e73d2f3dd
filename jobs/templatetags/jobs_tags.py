"""Template filters for job pages: log lines rendered by the same function the live stream uses."""

from __future__ import annotations

from django import template
from django.utils.safestring import mark_safe

from jobs.broadcast import log_line_html

register = template.Library()


@register.filter
def log_line(line) -> str:
    """A JobLogLine (or a (seq, stream, text) tuple) as the log box shows it; escaped inside."""
    if hasattr(line, "seq"):
        return mark_safe(log_line_html(line.seq, line.stream, line.text))
    seq, stream, text = line
    return mark_safe(log_line_html(seq, stream, text))
