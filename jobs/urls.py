from __future__ import annotations

from django.urls import path

from jobs import views as job_views

app_name = "jobs"
urlpatterns = [
    path("", job_views.job_list, name="list"),
    path("<int:pk>/", job_views.job_detail, name="detail"),
    path("<int:pk>/log.txt", job_views.job_log_download, name="log_download"),
    path("<int:pk>/cancel/", job_views.job_cancel, name="cancel"),
]
