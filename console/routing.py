"""Websocket routes of the site itself (mounted by ramdeck_site/asgi.py next to the apps' ones)."""

from __future__ import annotations

from django.urls import path

from console.consumers import DashboardConsumer

websocket_urlpatterns = [path("ws/dashboard/", DashboardConsumer.as_asgi())]
