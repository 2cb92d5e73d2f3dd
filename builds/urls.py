from __future__ import annotations

from django.urls import path

from builds import views

app_name = "builds"
urlpatterns = [
    path("<slug:name>/", views.node_builds, name="node"),
    path("<slug:name>/start/", views.node_build_start, name="start"),
]
