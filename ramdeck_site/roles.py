"""The four roles, as Django groups created by migrations: viewer < chat < operator < admin.

A chat member is a viewer who may also chat with running deployments and see their endpoint and API key
(as an operator may; the console's own host's stays the admins'); nothing that changes the cluster.

Role checks live here so views, templates and consumers ask one question ("may this user operate?") the
same way. A superuser counts as an admin.
"""

from __future__ import annotations

from functools import cache, wraps
from inspect import iscoroutinefunction

from asgiref.sync import sync_to_async
from django.core.exceptions import PermissionDenied

VIEWER = "viewer"
CHAT = "chat"
OPERATOR = "operator"
ADMIN = "admin"
ROLES = (VIEWER, CHAT, OPERATOR, ADMIN)  # lowest first
_RANK = {None: 0, **{role: rank for rank, role in enumerate(ROLES, start=1)}}


def role_of(user) -> str | None:
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    if user.is_superuser:
        return ADMIN
    cached = getattr(user, "_ramdeck_role", False)
    if cached is not False:
        return cached
    names = set(user.groups.values_list("name", flat=True))
    role = highest_role(names)
    user._ramdeck_role = role
    return role


def highest_role(names) -> str | None:
    """The highest of the roles among these group names (a user in two role groups counts as the higher)."""
    return next((r for r in reversed(ROLES) if r in names), None)


def has_role(user, needed: str) -> bool:
    return _RANK[role_of(user)] >= _RANK[needed]


def can_view(user) -> bool:
    return has_role(user, VIEWER)


def can_chat(user) -> bool:
    return has_role(user, CHAT)


def can_operate(user) -> bool:
    return has_role(user, OPERATOR)


def can_administer(user) -> bool:
    return has_role(user, ADMIN)


def require_role(request, needed: str) -> None:
    """Raise PermissionDenied (after an audit entry) when the user's role is below `needed`.

    For checks that depend on what is asked for, not only on which view is asked (e.g. a command on
    the console's own host needs more than a command on a remote node).
    """
    if not has_role(request.user, needed):
        # Imported here: this module is loaded with the app registry (by admin_site.py), before models may be.
        from audit import history

        history.record(
            request,
            "permission_denied",
            changes={"path": request.path, "method": request.method, "needed": needed},
        )
        raise PermissionDenied(f"This needs the {needed} role.")


def role_required(needed: str):
    """View decorator: 403 (and an audit entry) when the user's role is below `needed`."""

    def decorator(view):
        if iscoroutinefunction(view):
            # Async views (those that wait on a node) check the role in a thread: it may query the database.
            @wraps(view)
            async def async_wrapper(request, *args, **kwargs):
                await sync_to_async(require_role)(request, needed)
                return await view(request, *args, **kwargs)

            async_wrapper.required_role = needed
            return async_wrapper

        @wraps(view)
        def wrapper(request, *args, **kwargs):
            require_role(request, needed)
            return view(request, *args, **kwargs)

        wrapper.required_role = needed
        return wrapper

    return decorator


@cache
def route_roles() -> dict[str, str | None]:
    """`namespace:name` of every named route → the role its view declares with `role_required` (outer
    decorators made with functools.wraps carry the attribute along), or None when it declares none.
    Read once: the URL configuration does not change while the console runs."""
    from django.urls import URLPattern, URLResolver, get_resolver

    found: dict[str, str | None] = {}

    def walk(resolver, namespace: str) -> None:
        for entry in resolver.url_patterns:
            if isinstance(entry, URLResolver):
                walk(entry, f"{namespace}{entry.namespace}:" if entry.namespace else namespace)
            elif isinstance(entry, URLPattern) and entry.name:
                found.setdefault(f"{namespace}{entry.name}", getattr(entry.callback, "required_role", None))

    walk(get_resolver(), "")
    return found


def may_use(user, route: str) -> bool:
    """Whether the user's role opens the view behind the named route: what a page asks before it offers a
    button, a form or a link to it, so nobody is shown an action that would refuse them. Object-level
    refusals (the console's own host is the admins') are the page's own context (`may_control`, ...).
    A route without a declared role is open to every role. An unknown route name is a mistake in a
    template, and raises."""
    roles = route_roles()
    if route not in roles:
        raise ValueError(f"No route named {route!r}: check the name given to the `may` filter.")
    return has_role(user, roles[route] or VIEWER)


def role_context(request) -> dict:
    user = getattr(request, "user", None)
    return {
        "user_role": role_of(user) if user is not None else None,
        "can_chat": bool(user) and can_chat(user),
        "can_operate": bool(user) and can_operate(user),
        "can_administer": bool(user) and can_administer(user),
    }
