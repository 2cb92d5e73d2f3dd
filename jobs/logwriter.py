"""A job's log on its way out: lines buffered briefly, saved in bulk with gap-free `seq` numbers FIRST, then
sent to the channel group `job-<pk>` (jobs/broadcast.py), so a watcher can always catch up from the database.
"""

from __future__ import annotations

import asyncio
import contextlib

from django.conf import settings
from django.db import DatabaseError

from jobs import broadcast
from jobs.aio import db
from jobs.models import Job

# Output is saved in batches: at most this long after a line arrived, or as soon as this many wait.
FLUSH_DELAY_S = 0.05
FLUSH_LINES = 500
# One insert and one group message never carry more than this (a fast producer overfills the buffer
# between two wake-ups); the rest goes in the next batch at once.
MAX_BATCH_LINES = 2000
# A reader this far ahead of the database waits, so a flood of output cannot exhaust memory: in lines, and
# in characters (20,000 lines of the longest kind would be 650 million).
MAX_PENDING_LINES = 20_000
MAX_PENDING_CHARS = 8 * 2**20
# Past the per-job cap (settings), the middle of a log is dropped once this many more lines arrived.
TRIM_SLACK = 2000
# A single line longer than this (a binary blob, a minified file) is cut; the rest is not worth a page.
MAX_LINE_CHARS = 32_768


def clean_text(text: str) -> str:
    """A line the database accepts: no NUL (PostgreSQL refuses it), valid UTF-8, bounded length."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) > MAX_LINE_CHARS:
        text = text[:MAX_LINE_CHARS] + f" … [{len(text) - MAX_LINE_CHARS} more characters cut]"
    return text


class LogWriter:
    """Buffers lines and saves them in batches (then sends them) from one background task, in order."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._pending: list[tuple[str, str]] = []
        self._pending_chars = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        self._error: BaseException | None = None
        self._task: asyncio.Task | None = None
        self._trimmed_to = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"job-{self.job.pk}-log")

    async def write(self, stream: str, text: str) -> None:
        if self._error is not None:
            raise self._error
        text = clean_text(text)
        self._pending.append((stream, text))
        self._pending_chars += len(text)
        if len(self._pending) >= FLUSH_LINES or self._pending_chars >= MAX_PENDING_CHARS:
            self._wake.set()
        if len(self._pending) >= MAX_PENDING_LINES or self._pending_chars >= MAX_PENDING_CHARS:
            self._room.clear()
            await self._room.wait()

    async def close(self) -> None:
        """Save everything still buffered (the log cut to the cap); raise if saving failed."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._error is not None:
            raise self._error
        cap = settings.RAMDECK_JOB_LOG_MAX_LINES
        if cap and self.job.next_seq > cap:
            await db(self.job.trim_log)(cap // 2, cap - cap // 2)

    async def _loop(self) -> None:
        try:
            while True:
                if not self._closing:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), FLUSH_DELAY_S)
                self._wake.clear()
                while self._pending:
                    batch = self._pending[:MAX_BATCH_LINES]
                    del self._pending[:MAX_BATCH_LINES]
                    self._pending_chars -= sum(len(text) for _, text in batch)
                    await self._flush(batch)
                    if len(self._pending) < MAX_PENDING_LINES and self._pending_chars < MAX_PENDING_CHARS:
                        self._room.set()
                self._room.set()
                if self._closing:
                    return
        except BaseException as exc:
            self._error = exc
            self._room.set()

    async def _flush(self, batch: list[tuple[str, str]]) -> None:
        for attempt in range(3):
            try:
                rows = await db(self.job.append_lines)(batch)
                break
            except DatabaseError:
                # The insert is atomic, so a retry never duplicates; a busy SQLite file usually clears.
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5 * (attempt + 1))
        await broadcast.send_lines(self.job.pk, rows, self.job.notify_groups)
        await self._trim()

    async def _trim(self) -> None:
        """Past the per-job cap, drop the middle of the log (saved and sent already), keeping its head
        and tail; trimmed in steps of TRIM_SLACK lines, not after every batch."""
        cap = settings.RAMDECK_JOB_LOG_MAX_LINES
        slack = max(TRIM_SLACK, cap // 10)
        if not cap or self.job.next_seq < cap + slack or self.job.next_seq - self._trimmed_to < slack:
            return
        await db(self.job.trim_log)(cap // 2, cap - cap // 2)
        self._trimmed_to = self.job.next_seq
