"""ASGI entry point: HTTP through Django, websockets through Channels with session auth."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from console.routing import websocket_urlpatterns as site_routes  # noqa: E402
from deployments.routing import websocket_urlpatterns as deployment_routes  # noqa: E402
from jobs.routing import websocket_urlpatterns as job_routes  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(job_routes + deployment_routes + site_routes))
        ),
    }
)
