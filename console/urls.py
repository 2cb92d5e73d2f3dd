"""The console's own pages: the dashboard, login and password, users, and the audit history."""

from __future__ import annotations

from django.urls import include, path

from console import audit, users, views

user_urls = (
    [
        path("", users.user_list, name="list"),
        path("new/", users.user_create, name="create"),
        path("<int:pk>/", users.user_edit, name="edit"),
        path("<int:pk>/unlock/", users.user_unlock, name="unlock"),
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
    path("audit/", audit.audit_list, name="audit"),
    path("help/", views.help_page, name="help"),
    path("users/", include(user_urls)),
]
