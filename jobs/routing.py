"""Websocket routes (mounted by ramdeck_site/asgi.py behind session auth and the allowed-hosts check)."""

from __future__ import annotations

from django.urls import path

from jobs.consumers import JobListConsumer, JobLogConsumer

websocket_urlpatterns = [
    path("ws/jobs/", JobListConsumer.as_asgi()),
    path("ws/jobs/<int:pk>/", JobLogConsumer.as_asgi()),
]
