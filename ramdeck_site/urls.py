from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from jobs import views as jobs_views

from . import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("login/", views.RamdeckLoginView.as_view(), name="login"),
    path("logout/", views.logout_view, name="logout"),
    path("password/", views.RamdeckPasswordChangeView.as_view(), name="password_change"),
    path("password/done/", views.password_change_done, name="password_change_done"),
    path("nodes/", include("nodes.urls")),
    path("jobs/", include("jobs.urls")),
    path("audit/", jobs_views.audit_list, name="audit"),
    path("", include("deployments.urls")),
    path("admin/", admin.site.urls),
]
