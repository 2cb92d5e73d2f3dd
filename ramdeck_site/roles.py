"""The three roles, as Django groups created by a migration: viewer < operator < admin.

Role checks live here so views, templates and consumers ask one question ("may this user operate?") the
same way. A superuser counts as an admin.
"""

from __future__ import annotations

from functools import wraps
from inspect import iscoroutinefunction

from asgiref.sync import sync_to_async
from django.core.exceptions import PermissionDenied

VIEWER = "viewer"
OPERATOR = "operator"
ADMIN = "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
_RANK = {None: 0, VIEWER: 1, OPERATOR: 2, ADMIN: 3}


def role_of(user) -> str | None:
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    if user.is_superuser:
        return ADMIN
    cached = getattr(user, "_ramdeck_role", False)
    if cached is not False:
        return cached
    names = set(user.groups.values_list("name", flat=True))
    role = next((r for r in (ADMIN, OPERATOR, VIEWER) if r in names), None)
    user._ramdeck_role = role
    return role


def has_role(user, needed: str) -> bool:
    return _RANK[role_of(user)] >= _RANK[needed]


def can_view(user) -> bool:
    return has_role(user, VIEWER)


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

            return async_wrapper

        @wraps(view)
        def wrapper(request, *args, **kwargs):
            require_role(request, needed)
            return view(request, *args, **kwargs)

        return wrapper

    return decorator


def role_context(request) -> dict:
    user = getattr(request, "user", None)
    return {
        "user_role": role_of(user) if user is not None else None,
        "can_operate": bool(user) and can_operate(user),
        "can_administer": bool(user) and can_administer(user),
    }
