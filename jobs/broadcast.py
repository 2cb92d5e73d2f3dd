"""How job output and job states reach browsers: line markup, and group messages on the channel layer.

The runner saves lines first and sends them here second (AWX's callback receiver does the same), so a
message that is lost on the way costs a watcher nothing they cannot reload. Messages carry data only:
each line's (stream, text) after the first `seq`, which consumers render themselves with the function the
pages use (`log_line_html`), so no HTML travels through the channel layer to a browser. Status messages
carry only the job's id and state: consumers render the parts of the page that depend on the viewer (the
cancel button) themselves.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from html import escape

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from remote.text import printable

logger = logging.getLogger(__name__)

# Everyone watching the job list; status changes of every job go here too.
LIST_GROUP = "jobs"

# ANSI escape sequences: CSI (colours, cursor moves), OSC (window titles, hyperlinks), and the short
# two-byte forms. Build tools colour their output; a web page must never show the raw codes.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def group_name(job_id: int) -> str:
    """Channel-layer group of one job. A hyphen, because colons are not valid in group names."""
    return f"job-{job_id}"


def plain_text(text: str) -> str:
    """What a person should read: ANSI codes stripped, a carriage-return progress line reduced to its
    final state (what a terminal would show), other control characters and the bidi and other format
    characters (a right-to-left override would make the page or a downloaded log read otherwise than it
    is) dropped; tabs and newlines kept."""
    if text.isprintable():  # The common case, and a cheap test: nothing to strip.
        return text
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:
        text = next((part for part in reversed(text.split("\r")) if part), "")
    return printable(text, None, lines=True)


def log_line_html(seq: int, stream: str, text: str) -> str:
    """One log line as the page shows it. No whitespace around it: the log box is `white-space: pre-wrap`.
    (The standard library's escape: Django's adds a lazy-string wrapper that costs more than the escaping.)"""
    return f'<div class="{stream}" data-seq="{seq}">{escape(plain_text(text)) or " "}</div>'


def lines_message(job_id: int, rows: Iterable) -> dict:
    """The group message for saved lines with consecutive seqs: (seq, stream, text) tuples as
    `JobLogLine.append_lines` returns them, or JobLogLine rows. Carries the first seq and each line's
    (stream, text), never markup: each consumer renders what it sends (`log_line_html`, which escapes), so
    nothing that reaches the channel layer (a shared Redis) is ever forwarded to a browser as HTML. A
    consumer drops what it already sent by slicing rather than line by line."""
    rows = [(row.seq, row.stream, row.text) if hasattr(row, "seq") else row for row in rows]
    first = rows[0][0]
    if rows[-1][0] - first != len(rows) - 1:
        raise ValueError("lines_message needs consecutive seqs")
    return {
        "type": "job.lines",
        "job_id": job_id,
        "first": first,
        "lines": [[stream, text] for _, stream, text in rows],
    }


STREAMS = frozenset({"out", "err", "sys"})


def rows_of(message: dict) -> list[tuple[int, str, str]]:
    """(seq, stream, text) of a `job.lines` message, whatever it holds: a seq that is not a number makes no
    rows, an unknown stream is shown as output, text is text. The consumer renders these itself."""
    first, lines = message.get("first"), message.get("lines")
    if not isinstance(first, int) or isinstance(first, bool) or not isinstance(lines, list):
        return []
    rows = []
    for offset, line in enumerate(lines):
        stream, text = (line[0], line[1]) if isinstance(line, list | tuple) and len(line) == 2 else ("", line)
        rows.append((first + offset, stream if stream in STREAMS else "out", str(text)))
    return rows


def status_message(job_id: int, state: str) -> dict:
    return {"type": "job.status", "job_id": job_id, "state": state}


async def send_lines(job_id: int, rows: list, also: Iterable[str] = ()) -> None:
    """To the job's group, and to the groups in `also` (a page that follows a larger job: the job's
    params["notify"], see Job.notify_groups)."""
    if rows:
        message = lines_message(job_id, rows)
        for group in (group_name(job_id), *also):
            await _group_send(group, message)


async def send_status(job_id: int, state: str, also: Iterable[str] = ()) -> None:
    message = status_message(job_id, state)
    for group in (group_name(job_id), LIST_GROUP, *also):
        await _group_send(group, message)


def send_lines_sync(job_id: int, rows: list, also: Iterable[str] = ()) -> None:
    """For synchronous callers (views, the sweeper)."""
    call_sync(send_lines, job_id, rows, also)


def send_status_sync(job_id: int, state: str, also: Iterable[str] = ()) -> None:
    call_sync(send_status, job_id, state, also)


async def send_event(group: str, message: dict) -> None:
    """Any other message to a group (a deployment's page, say): best effort, like the others."""
    await _group_send(group, message)


def call_sync(func, *args):
    """`async_to_sync(func)(*args)`; from a thread whose own event loop is running (Playwright's sync
    API keeps one on the test thread), which async_to_sync refuses, in a short-lived thread instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return async_to_sync(func)(*args)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(async_to_sync(func), *args).result()


async def _group_send(group: str, message: dict) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(group, message)
    except Exception as exc:
        logger.warning("Could not send to channel group %s: %s", group, exc)
