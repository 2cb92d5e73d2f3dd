from __future__ import annotations

from django.urls import path

from ramdeck_site.views import not_built_yet

app_name = "deployments"
urlpatterns = [
    path("models/", not_built_yet, name="models"),
    path("deployments/", not_built_yet, name="list"),
    path("deployments/<int:pk>/", not_built_yet, name="detail"),
]
