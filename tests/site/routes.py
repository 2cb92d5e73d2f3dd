"""Every route of the URL configuration (HTTP and websocket), each with a URL filled from the role matrix's
small world (the `world` fixture in tests/site/conftest.py)."""

from __future__ import annotations

from channels.routing import URLRouter
from django.contrib.contenttypes.models import ContentType
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from ramdeck_site.asgi import application

ROLES = ("anonymous", "viewer", "chat", "operator", "admin")


def http_routes(resolver=None, namespace: str = "", prefix: str = "") -> list[tuple[str, URLPattern]]:
    """(key, pattern) for every HTTP route: `namespace:name`, or the full path pattern of an unnamed one."""
    routes = []
    for entry in (resolver or get_resolver()).url_patterns:
        if isinstance(entry, URLResolver):
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            routes += http_routes(entry, inner, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            key = f"{namespace}{entry.name}" if entry.name else prefix + str(entry.pattern)
            routes.append((key, entry))
    return routes


def websocket_routes() -> list[str]:
    """The path patterns of the URLRouter inside the ASGI application's websocket stack."""
    app = application.application_mapping["websocket"]
    while not isinstance(app, URLRouter):
        app = getattr(app, "application", None) or app.inner
    return [str(route.pattern) for route in app.routes]


HTTP_ROUTES = http_routes()


WS_ROUTES = websocket_routes()


def _pk_of(key: str, data: dict) -> int:
    if key.startswith("nodes:credential"):
        return data["credential"].pk
    if key.startswith("jobs:"):
        return data["job"].pk
    if key in ("modelfiles:detail", "deployments:plan", "deployments:confirm", "deployments:manual"):
        return data["model"].pk
    if key == "deployments:stale_reap":
        return data["stale"].pk
    if key.startswith(("deployments:", "chat:")):
        return data["deployment"].pk
    if key in ("users:edit", "users:unlock"):
        return data["users"]["viewer"].pk
    raise AssertionError(f"{key}: say in _pk_of which object its <pk> is")


def _admin_object_id(key: str, data: dict) -> str:
    if "auth_group" in key or "auth/group" in key:
        return str(data["group"].pk)
    if "auditevent" in key:
        return str(data["event"].pk)
    return str(data["users"]["admin"].pk)  # users, and axes' (empty) tables


def url_of(key: str, pattern: URLPattern, data: dict) -> str:
    names = set(pattern.pattern.regex.groupindex)
    if pattern.name is None:
        # Unnamed admin routes: fill the regex by hand.
        path = "/" + key.replace("(?P<url>.*)$", "nothing-here/")
        return path.replace("<path:object_id>", _admin_object_id(key, data))
    kwargs: dict[str, object] = {}
    for name in names:
        if name == "name":
            kwargs[name] = data["node"].name
        elif name == "pk":
            kwargs[name] = _pk_of(key, data)
        elif name in ("object_id", "id"):
            kwargs[name] = _admin_object_id(key, data)
        elif name == "app_label":
            kwargs[name] = "auth"
        elif name == "content_type_id":
            kwargs[name] = ContentType.objects.get_for_model(data["users"]["admin"]).pk
        else:
            raise AssertionError(f"{key}: no way yet to fill <{name}> in tests/site/test_security_roles.py")
    return reverse(key, kwargs=kwargs)
