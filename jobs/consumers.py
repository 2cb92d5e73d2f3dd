"""Websockets for live jobs: one job's log (ws/jobs/<pk>/) and the job list's status badges (ws/jobs/).

Every message is an HTML fragment that htmx's ws extension swaps out of band, rendered here from the same
partials as the pages and from data only: the channel layer brings (seq, stream, text), never markup. The
log consumer joins the job's group BEFORE it reads the backlog from the database, then drops any line whose
`seq` it has already sent: a line saved before the backlog query is in the backlog, a line saved after it
arrives through the group (the runner saves, then sends), and lines in both are sent once. A client that
reconnects says where it was with `?after=<seq>`.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.template.loader import render_to_string
from django.utils.safestring import mark_safe

from jobs.broadcast import LIST_GROUP, group_name, log_line_html, rows_of
from jobs.models import TERMINAL_STATES, Job, JobLogLine, may_read_log
from jobs.sockets import FORBIDDEN, UserBoundConsumer
from ramdeck_site.roles import can_operate, can_view

BACKLOG_CHUNK = 2000


def _may_view(user) -> bool:
    return bool(user is not None and user.is_authenticated and can_view(user))


def _may_read(user, job_id: int) -> bool:
    """Whether the job exists and `user` may read its log (admins only for the console's own host)."""
    if user is None or not user.is_authenticated:
        return False
    job = Job.objects.select_related("node").filter(pk=job_id).first()
    return job is not None and may_read_log(user, job)


def _parse_after(scope) -> int:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("after", [])
    try:
        return max(-1, int(values[-1]))
    except (IndexError, ValueError):
        return -1


class JobLogConsumer(UserBoundConsumer, AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.job_id = int(self.scope["url_route"]["kwargs"]["pk"])
        if not await database_sync_to_async(_may_read)(self.scope.get("user"), self.job_id):
            await self.close(code=FORBIDDEN)
            return
        self.group = group_name(self.job_id)
        self.last_seq = _parse_after(self.scope)
        self.finished = False
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.bind_to_user()
        await self._send_from_database(before=None)
        await self._send_status()

    async def disconnect(self, code: int) -> None:
        await self.unbind_from_user()
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        """Clients only listen; whatever they send is ignored."""

    async def may_stay(self, user) -> bool:
        # An admin who stops being one while watching a log of the console's own host stops watching it.
        return await database_sync_to_async(_may_read)(user, self.job_id)

    async def job_lines(self, event: dict) -> None:
        # Data from the channel layer, rendered (escaped) here: never markup passed through.
        rows = rows_of(event)
        if not rows or rows[-1][0] <= self.last_seq:
            return
        first = rows[0][0]
        if first > self.last_seq + 1:
            # A message went missing on the way (channel full, expired): fill the gap from the database.
            await self._send_from_database(before=first)
        fresh = rows[max(0, self.last_seq + 1 - first) :]
        await self._send_html([log_line_html(*row) for row in fresh], rows[-1][0])

    async def job_status(self, event: dict) -> None:
        await self._send_status()

    async def _send_from_database(self, *, before: int | None) -> None:
        while True:
            rows = await database_sync_to_async(self._read_lines)(self.last_seq, before)
            if rows:
                await self._send_html([log_line_html(*row) for row in rows], rows[-1][0])
            if len(rows) < BACKLOG_CHUNK:
                return

    def _read_lines(self, after: int, before: int | None) -> list[tuple[int, str, str]]:
        lines = JobLogLine.objects.filter(job_id=self.job_id, seq__gt=after)
        if before is not None:
            lines = lines.filter(seq__lt=before)
        return list(lines.order_by("seq").values_list("seq", "stream", "text")[:BACKLOG_CHUNK])

    async def _send_html(self, lines: list[str], last_seq: int) -> None:
        """Send rendered lines (escaped by log_line_html) ending at `last_seq`, out of band into the log."""
        context = {"job_id": self.job_id, "lines_html": mark_safe("".join(lines))}
        html = render_to_string("jobs/job_detail.html#log-append", context)
        self.last_seq = last_seq
        await self.send(text_data=html)

    async def _send_status(self) -> None:
        html, state = await database_sync_to_async(self._render_summary)()
        if html is None:
            return
        await self.send(text_data=html)
        if state in TERMINAL_STATES and not self.finished:
            # Everything was saved and sent before the final state: nothing more will come.
            self.finished = True
            await self.close(code=1000)

    def _render_summary(self) -> tuple[str | None, str | None]:
        job = Job.objects.select_related("node", "created_by").filter(pk=self.job_id).first()
        if job is None:
            return None, None
        user = self.scope["user"]
        context = {"job": job, "oob": True, "user": user, "can_operate": can_operate(user)}
        return render_to_string("jobs/job_detail.html#summary", context), job.state


class JobListConsumer(UserBoundConsumer, AsyncWebsocketConsumer):
    """Status badges of the job list: every job's state change, as an out-of-band badge."""

    async def connect(self) -> None:
        if not await database_sync_to_async(_may_view)(self.scope.get("user")):
            await self.close(code=FORBIDDEN)
            return
        self.group = LIST_GROUP
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.bind_to_user()

    async def disconnect(self, code: int) -> None:
        await self.unbind_from_user()
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        """Clients only listen."""

    async def job_status(self, event: dict) -> None:
        html = await database_sync_to_async(self._render_badge)(event["job_id"])
        if html:
            await self.send(text_data=html)

    async def job_lines(self, event: dict) -> None:
        """Not sent to this group; ignored if it ever is."""

    def _render_badge(self, job_id: int) -> str | None:
        job = Job.objects.filter(pk=job_id).first()
        if job is None:
            return None
        return render_to_string("jobs/job_list.html#badge", {"job": job, "oob": True})
