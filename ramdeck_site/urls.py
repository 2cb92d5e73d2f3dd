from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from audit.views import audit_list
from nodes.command_views import run_command

from . import user_views, views

user_urls = (
    [
        path("", user_views.user_list, name="list"),
        path("new/", user_views.user_create, name="create"),
        path("<int:pk>/", user_views.user_edit, name="edit"),
        path("<int:pk>/unlock/", user_views.user_unlock, name="unlock"),
    ],
    "users",
)

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("dashboard/live/", views.dashboard_live_regions, name="dashboard_live"),
    path("login/", views.RamdeckLoginView.as_view(), name="login"),
    path("logout/", views.logout_view, name="logout"),
    path("password/", views.RamdeckPasswordChangeView.as_view(), name="password_change"),
    path("password/done/", views.password_change_done, name="password_change_done"),
    path("nodes/", include("nodes.urls")),
    # Kept under /jobs/: a command is a job, though the form (and its node choices) belongs to nodes.
    path("jobs/new/", run_command, name="run_command"),
    path("jobs/", include("jobs.urls")),
    path("audit/", audit_list, name="audit"),
    path("users/", include(user_urls)),
    path("", include("deployments.urls")),
    path("admin/", admin.site.urls),
]
