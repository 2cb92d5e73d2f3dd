"""Websocket routes of deployments (mounted by ramdeck_site/asgi.py next to the jobs' ones)."""

from __future__ import annotations

from django.urls import path

from deployments.consumers import DeploymentConsumer

websocket_urlpatterns = [path("ws/deployments/<int:pk>/", DeploymentConsumer.as_asgi())]
