from __future__ import annotations

from django.contrib import admin

from audit.models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Read-only: the audit history cannot be edited or deleted, not even here."""

    list_display = ("at", "actor_name", "action", "object_type", "object_repr", "source_ip")
    list_filter = ("action", "object_type")
    search_fields = ("actor_name", "action", "object_repr")
    actions = None

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
