"""The URL configuration: each app's routes under the paths the console has always had. Wiring only: this
module (with asgi.py) is the one place of ramdeck_site that imports the apps above it."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from nodes.views.commands import run_command

urlpatterns = [
    path("", include("console.urls")),
    # Before nodes' own routes, which take any name after /nodes/.
    path("nodes/", include("calibration.urls")),
    path("nodes/", include("nodes.urls")),
    # Kept under /jobs/: a command is a job, though the form (and its node choices) belongs to nodes.
    path("jobs/new/", run_command, name="run_command"),
    path("jobs/", include("jobs.urls")),
    path("models/", include("modelfiles.urls")),
    path("builds/", include("builds.urls")),
    path("", include("deployments.urls")),
    path("", include("chat.urls")),
    path("admin/", admin.site.urls),
]

# Logs the error with a reference the page shows (ramdeck_site/errors.py).
handler500 = "ramdeck_site.errors.server_error"
