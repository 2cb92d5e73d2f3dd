"""Django admin behind the RAMDeck admin role (user management), with the audit history read-only."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.apps import AdminConfig

from .roles import can_administer


class RamdeckAdminSite(admin.AdminSite):
    site_header = "RAMDeck administration"
    site_title = "RAMDeck admin"
    index_title = "Users and roles"

    def has_permission(self, request) -> bool:
        # The admin role, not Django's is_staff flag, opens the admin: one notion of "admin" everywhere.
        return can_administer(request.user)


class RamdeckAdminConfig(AdminConfig):
    default_site = "ramdeck_site.admin_site.RamdeckAdminSite"
