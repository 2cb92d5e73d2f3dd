"""Websockets end with what let them open: logging out closes the sockets of that session, and losing the
viewer role (or the account being disabled) or a new password closes every socket of that user, at once
rather than at the next reconnect. Consumers mix in `UserBoundConsumer`; the signal receivers below feed a
group per user.

Signals, not explicit calls: roles change in Django admin, where the console has no view of its own.
"""

from __future__ import annotations

import asyncio
import contextlib

from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.db import transaction
from django.db.models.signals import m2m_changed, post_save, pre_save

from jobs import broadcast
from ramdeck_site.roles import can_view

# Close codes the page can tell apart: logged out, and no longer allowed.
LOGGED_OUT = 4401
FORBIDDEN = 4403


def user_group(user_id: int) -> str:
    return f"user-{user_id}"


class UserBoundConsumer:
    """For AsyncWebsocketConsumer subclasses: call `await self.bind_to_user()` after accept() and
    `await self.unbind_from_user()` in disconnect()."""

    user_group_name: str | None = None

    async def bind_to_user(self) -> None:
        user = self.scope.get("user")
        if user is not None and user.is_authenticated:
            self.user_group_name = user_group(user.pk)
            await self.channel_layer.group_add(self.user_group_name, self.channel_name)

    async def unbind_from_user(self) -> None:
        if self.user_group_name:
            await self.channel_layer.group_discard(self.user_group_name, self.channel_name)
            self.user_group_name = None

    async def user_logged_out(self, event: dict) -> None:
        session = self.scope.get("session")
        own = getattr(session, "session_key", None)
        if event.get("session_key") in (None, own):
            await self.close(code=LOGGED_OUT)

    async def user_roles_changed(self, event: dict) -> None:
        fresh, allowed = await database_sync_to_async(_fresh_user)(event["user_id"])
        if not allowed or not await self.may_stay(fresh):
            await self.close(code=FORBIDDEN)
            return
        self.scope["user"] = fresh  # what it may do now (an operator's buttons) follows the new role

    async def may_stay(self, user) -> bool:
        """Whether `user`, who may still view, may still watch this socket (a consumer that needs more than
        the viewer role says what)."""
        return True


class CoalescedRenderConsumer:
    """For AsyncWebsocketConsumer subclasses that send a page's live regions again whenever something
    changes: `render_soon()` on every message that matters renders once, `coalesce_s` later, however many
    arrive meanwhile; `render()` (sync, may query) returns the HTML to send, "" for nothing. Call
    `cancel_render()` in disconnect()."""

    coalesce_s = 0.25
    _pending: asyncio.Task | None = None

    def render(self) -> str:
        raise NotImplementedError

    def render_soon(self) -> None:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.create_task(self._render_later())

    def cancel_render(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    async def render_and_send(self) -> None:
        html = await database_sync_to_async(self.render)()
        if html:
            await self.send(text_data=html)

    async def _render_later(self) -> None:
        await asyncio.sleep(self.coalesce_s)
        with contextlib.suppress(Exception):  # a closed socket: nothing to tell
            await self.render_and_send()


def _fresh_user(user_id: int):
    """The user as the database has it now (its role is worked out again), and whether it may watch."""
    user = get_user_model().objects.filter(pk=user_id).first()
    return user, bool(user is not None and can_view(user))


def _tell(user_id: int, message: dict) -> None:
    broadcast.call_sync(broadcast.send_event, user_group(user_id), message)


def _logged_out(sender, request, user, **kwargs) -> None:
    if user is not None:
        session_key = getattr(getattr(request, "session", None), "session_key", None)
        _tell(user.pk, {"type": "user.logged_out", "session_key": session_key})


def _groups_changed(sender, instance, action, reverse, pk_set, **kwargs) -> None:
    if action not in ("post_add", "post_remove", "post_clear"):
        return
    # From the user's side (user.groups.remove(...)) the instance is the user; from the group's side
    # (group.user_set.remove(...)) the users are pk_set, unknown after a clear: tell the group's members.
    if not reverse:
        user_ids = [instance.pk]
    else:
        user_ids = list(pk_set or instance.user_set.values_list("pk", flat=True))
    for user_id in user_ids:
        _tell(user_id, {"type": "user.roles_changed", "user_id": user_id})


def _password_before_save(sender, instance, update_fields=None, **kwargs) -> None:
    """Note whether this save changes the stored password hash. Read back from the database: a password
    changes through the console's form, Django admin, `manage.py changepassword` or a plain assignment, and
    only the stored hash tells them all apart from any other save."""
    if instance.pk is None or (update_fields is not None and "password" not in update_fields):
        return
    stored = sender._default_manager.filter(pk=instance.pk).values_list("password", flat=True).first()
    instance._ramdeck_password_changed = stored is not None and stored != instance.password


def _user_saved(sender, instance, created, update_fields=None, **kwargs) -> None:
    if not created and (update_fields is None or {"is_active", "is_superuser"} & set(update_fields)):
        _tell(instance.pk, {"type": "user.roles_changed", "user_id": instance.pk})
    if getattr(instance, "_ramdeck_password_changed", False):
        instance._ramdeck_password_changed = False
        # A new password ends every session of the user (Django checks each session's password hash; the
        # session that changed it gets a new key), so every socket ends too, as at a logout. Once the
        # change is committed: a rolled-back one changed nothing.
        user_id = instance.pk
        transaction.on_commit(lambda: _tell(user_id, {"type": "user.logged_out", "session_key": None}))


def connect_signals() -> None:
    user_model = get_user_model()
    user_logged_out.connect(_logged_out, dispatch_uid="ramdeck-watchers-logout")
    m2m_changed.connect(
        _groups_changed, sender=user_model.groups.through, dispatch_uid="ramdeck-watchers-groups"
    )
    pre_save.connect(_password_before_save, sender=user_model, dispatch_uid="ramdeck-watchers-password")
    post_save.connect(_user_saved, sender=user_model, dispatch_uid="ramdeck-watchers-user")
