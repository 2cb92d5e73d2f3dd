"""The dashboard over a websocket (ws/dashboard/): its live regions rendered again whenever a job changes
state (the job list's group) or a deployment changes (deployments/live.py's dashboard group), and sent to be
swapped out of band. A burst of changes makes one render."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.template.loader import render_to_string

from console import dashboard as dashboard_live
from deployments.live import DASHBOARD_GROUP
from jobs.broadcast import LIST_GROUP
from jobs.sockets import FORBIDDEN, CoalescedRenderConsumer, UserBoundConsumer
from ramdeck_site.roles import can_operate, can_view


def _may_view(user) -> bool:
    return bool(user is not None and user.is_authenticated and can_view(user))


class DashboardConsumer(UserBoundConsumer, CoalescedRenderConsumer, AsyncWebsocketConsumer):
    groups_joined: tuple[str, ...] = ()
    coalesce_s = 0.3  # changes arriving within this long of each other are shown together

    async def connect(self) -> None:
        if not await database_sync_to_async(_may_view)(self.scope.get("user")):
            await self.close(code=FORBIDDEN)
            return
        self.groups_joined = (LIST_GROUP, DASHBOARD_GROUP)
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        await self.bind_to_user()
        await self.render_and_send()  # whatever changed between the page load and now

    async def disconnect(self, code: int) -> None:
        await self.unbind_from_user()
        self.cancel_render()
        for group in self.groups_joined:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        """Clients only listen."""

    async def job_status(self, event: dict) -> None:
        self.render_soon()

    async def job_lines(self, event: dict) -> None:
        """Log lines do not change the dashboard."""

    async def deployment_changed(self, event: dict) -> None:
        self.render_soon()

    async def dashboard_changed(self, event: dict) -> None:
        self.render_soon()

    def render(self) -> str:
        user = self.scope["user"]
        context = {
            **dashboard_live.live_context(user=user),
            "oob": True,
            "user": user,
            "can_operate": can_operate(user),
            # The reap buttons post with the CSRF cookie's secret, which Django accepts as the form token.
            "csrf_token": self.scope.get("cookies", {}).get(settings.CSRF_COOKIE_NAME, ""),
        }
        return "".join(render_to_string(name, context) for name in dashboard_live.REGIONS)
