"""ASGI entry point: HTTP through Django, websockets through Channels with session auth."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator

from console.routing import websocket_urlpatterns as site_routes
from deployments.routing import websocket_urlpatterns as deployment_routes
from jobs.routing import websocket_urlpatterns as job_routes

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(job_routes + deployment_routes + site_routes))
        ),
    }
)
