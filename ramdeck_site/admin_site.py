"""Django admin behind the RAMDeck admin role (user management), with the audit history read-only."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.apps import AdminConfig
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.contrib.auth.decorators import login_not_required
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.decorators import method_decorator
from django.utils.translation import gettext as _
from django.views.decorators.cache import never_cache

from ramdeck_site.roles import can_administer


class RamdeckAdminSite(admin.AdminSite):
    site_header = "RAMDeck administration"
    site_title = "RAMDeck admin"
    index_title = "Users and roles"

    def has_permission(self, request) -> bool:
        # The admin role, not Django's is_staff flag, opens the admin: one notion of "admin" everywhere.
        return can_administer(request.user)

    @method_decorator(never_cache)
    @login_not_required
    def login(self, request, extra_context=None):
        """Django's AdminSite.login (6.1), with the audited login view in place of Django's: a second door
        to the same accounts must leave the same trace in the history."""
        # Imported here: this module is loaded with the app registry, before models may be imported.
        from django.contrib.admin.forms import AdminAuthenticationForm
        from django.contrib.auth.views import LoginView

        from ramdeck_site.login_audit import AuditedAdminLoginView

        redirect_url = LoginView().get_redirect_url(request) or reverse("admin:index", current_app=self.name)
        if request.method == "GET" and self.has_permission(request):
            return HttpResponseRedirect(redirect_url)
        context = {
            **self.each_context(request),
            "title": _("Log in"),
            "subtitle": None,
            "app_path": request.get_full_path(),
            "username": request.user.get_username(),
            REDIRECT_FIELD_NAME: redirect_url,
            **(extra_context or {}),
        }
        request.current_app = self.name
        return AuditedAdminLoginView.as_view(
            extra_context=context,
            authentication_form=self.login_form or AdminAuthenticationForm,
            template_name=self.login_template or "admin/login.html",
        )(request)


class RamdeckAdminConfig(AdminConfig):
    default_site = "ramdeck_site.admin_site.RamdeckAdminSite"
