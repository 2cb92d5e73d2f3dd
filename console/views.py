"""Site-wide pages: dashboard, login/logout with audit, password change."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth import logout
from django.contrib.auth import views as auth_views
from django.db.models import Count
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.urls import reverse_lazy
from django.views.decorators.http import require_POST

from audit import history
from audit.models import AuditEvent
from console import dashboard as dashboard_live
from console.first_run import first_run_context
from deployments.models import ACTIVE_STATES as DEPLOYMENT_ACTIVE_STATES
from deployments.models import Deployment
from jobs.models import Job
from nodes.models import Node
from ramdeck_site.login_audit import AuditedLoginMixin
from ramdeck_site.roles import VIEWER, can_view, role_required


@role_required(VIEWER)
def help_page(request):
    """The words of the console (context, KV cache, blocks, split, RPC worker, ...) in plain language; the
    forms' hints link here."""
    return render(request, "console/help.html")


def dashboard(request):
    if not can_view(request.user):
        # Logged in but in no role: a page that says so, and no inventory queries at all.
        return render(request, "console/dashboard.html", {})
    nodes = Node.objects.all()
    reachability = dict(nodes.values_list("reachability").annotate(n=Count("pk")))
    context = {
        "node_count": nodes.count(),
        "enabled_count": nodes.filter(enabled=True).count(),
        "reachable_count": reachability.get("reachable", 0),
        "unreachable_nodes": nodes.filter(enabled=True).exclude(reachability__in=["reachable", "unknown"]),
        "recent_jobs": Job.objects.select_related("node")[:8],
        "active_deployments": Deployment.objects.filter(state__in=DEPLOYMENT_ACTIVE_STATES).select_related(
            "model_file", "coordinator"
        ),
        "recent_events": AuditEvent.objects.all()[:8],
        **dashboard_live.live_context(user=request.user),
        **first_run_context(request.user),
    }
    return render(request, "console/dashboard.html", context)


@role_required(VIEWER)
def dashboard_live_regions(request):
    """The dashboard's live regions, out of band: the polling fallback while its websocket is not open."""
    context = {**dashboard_live.live_context(user=request.user), "oob": True}
    html = "".join(render_to_string(name, context, request=request) for name in dashboard_live.REGIONS)
    return HttpResponse(html)


class RamdeckLoginView(AuditedLoginMixin, auth_views.LoginView):
    """Django's login, with the audit entries the console promises: success and failure
    (ramdeck_site/login_audit.py, which Django admin's login uses too)."""

    redirect_authenticated_user = True


@require_POST
def logout_view(request):
    if request.user.is_authenticated:
        history.record(request, "logout", request.user)
    logout(request)
    messages.success(request, "You are logged out.")
    return redirect("login")


class RamdeckPasswordChangeView(auth_views.PasswordChangeView):
    success_url = reverse_lazy("password_change_done")

    def form_valid(self, form):
        response = super().form_valid(form)
        history.record(self.request, "user.password_change", self.request.user)
        return response


def password_change_done(request):
    messages.success(request, "Your password has been changed.")
    return redirect("dashboard")
