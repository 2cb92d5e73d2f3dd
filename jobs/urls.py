from __future__ import annotations

from django.urls import path

from ramdeck_site.views import not_built_yet

app_name = "jobs"
urlpatterns = [
    path("", not_built_yet, name="list"),
    path("<int:pk>/", not_built_yet, name="detail"),
]
