"""Job pages live in job_views.py; the audit page in audit_views.py. Kept for URL imports."""

from __future__ import annotations

from .audit_views import audit_list

__all__ = ["audit_list"]
