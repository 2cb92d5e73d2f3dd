"""The deployment page over a websocket (ws/deployments/<pk>/): one group per deployment, fed by its runs'
and steps' status and log lines and by the deployment's own changes (deployments/live.py). Whatever
arrives, the consumer renders the page's live regions again (state, steps with their last log lines, the
buttons) and sends them to be swapped out of band; a burst of messages makes one render."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.template.loader import render_to_string

from deployments import live
from deployments.models import Deployment
from deployments.views.run import run_context
from jobs.sockets import FORBIDDEN, CoalescedRenderConsumer, UserBoundConsumer
from ramdeck_site.roles import can_view


def _may_view(user) -> bool:
    return bool(user is not None and user.is_authenticated and can_view(user))


class DeploymentConsumer(UserBoundConsumer, CoalescedRenderConsumer, AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.deployment_id = int(self.scope["url_route"]["kwargs"]["pk"])
        self.group = None
        user = self.scope.get("user")
        allowed = await database_sync_to_async(_may_view)(user)
        exists = await database_sync_to_async(Deployment.objects.filter(pk=self.deployment_id).exists)()
        if not allowed or not exists:
            await self.close(code=FORBIDDEN)
            return
        self.group = live.group_name(self.deployment_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.bind_to_user()
        await self.render_and_send()  # whatever changed between the page load and now

    async def disconnect(self, code: int) -> None:
        await self.unbind_from_user()
        self.cancel_render()
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        """Clients only listen."""

    async def deployment_changed(self, event: dict) -> None:
        self.render_soon()

    async def job_status(self, event: dict) -> None:
        self.render_soon()

    async def job_lines(self, event: dict) -> None:
        self.render_soon()

    def render(self) -> str:
        deployment = (
            Deployment.objects.select_related("coordinator", "model_file", "created_by")
            .filter(pk=self.deployment_id)
            .first()
        )
        if deployment is None:
            return ""
        context = {
            **run_context(self.scope["user"], deployment),
            "oob": True,
            # The page's forms post with the CSRF cookie's secret, which Django accepts as the form token.
            "csrf_token": self.scope.get("cookies", {}).get(settings.CSRF_COOKIE_NAME, ""),
        }
        template = "deployments/lifecycle/run.html"
        return render_to_string(f"{template}#actions", context) + render_to_string(f"{template}#run", context)
