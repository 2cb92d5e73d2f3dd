"""Reading llama-server's HTTP answers with a bound: whatever answers at a node's address decides how much it
sends, the console decides how much it reads.

The body is read raw (as it came, not decompressed) and the requests ask for no compression (`IDENTITY`), so
a small compressed answer cannot unfold into a large one inside the console. Used by the deployment steps
(health wait, measure), the monitor and the chat proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

# Request headers for every call to llama-server whose answer is read here.
IDENTITY = {"Accept-Encoding": "identity"}
# A JSON answer (/completion of the measure step, /health, an error) is far below this.
MAX_ANSWER_BYTES = 1 * 2**20
# The most of an error body kept to quote from it (its first few hundred characters are shown).
MAX_ERROR_BYTES = 64 * 1024
# One line of an event stream: a chunk of a chat answer is a few hundred bytes.
MAX_LINE_BYTES = 1 * 2**20


class AnswerTooLarge(Exception):
    """The answer (or one of its lines) is larger than the console reads; the message says how large."""


async def read_capped(
    response: httpx.Response, limit: int = MAX_ANSWER_BYTES, *, what: str = "answer"
) -> bytes:
    """A streamed response's body, at most `limit` bytes; AnswerTooLarge past that (the rest is not read)."""
    data = bytearray()
    async for chunk in response.aiter_raw():
        data += chunk
        if len(data) > limit:
            raise AnswerTooLarge(f"llama-server's {what} is larger than {limit} bytes; not read further")
    return bytes(data)


async def read_prefix(response: httpx.Response, limit: int = MAX_ERROR_BYTES) -> bytes:
    """The first `limit` bytes of a streamed response's body (an error to quote); the rest is not read."""
    data = bytearray()
    async for chunk in response.aiter_raw():
        data += chunk[: limit - len(data)]
        if len(data) >= limit:
            break
    return bytes(data)


async def capped_lines(response: httpx.Response, max_line: int = MAX_LINE_BYTES) -> AsyncIterator[str]:
    """The lines of a streamed response as they arrive (decoded, line ending trimmed); AnswerTooLarge when
    one is longer than `max_line` bytes, before more of it is held."""
    pending = b""
    async for chunk in response.aiter_raw():
        parts = (pending + chunk).split(b"\n")
        pending = parts.pop()
        for part in parts:
            if len(part) > max_line:
                raise AnswerTooLarge(f"llama-server sent a line longer than {max_line} bytes")
            yield part.decode("utf-8", "replace").rstrip("\r")
        if len(pending) > max_line:
            raise AnswerTooLarge(f"llama-server sent a line longer than {max_line} bytes")
    if pending:
        yield pending.decode("utf-8", "replace").rstrip("\r")


async def fetch(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    limit: int = MAX_ANSWER_BYTES,
    what: str = "answer",
    **kwargs,
) -> tuple[int, bytes]:
    """(status, body) of one request whose answer is read with a bound: at most `limit` bytes of a 200
    answer (AnswerTooLarge past that), the first MAX_ERROR_BYTES of any other."""
    headers = {**IDENTITY, **(kwargs.pop("headers", None) or {})}
    async with client.stream(method, url, headers=headers, **kwargs) as response:
        if response.status_code != 200:
            return response.status_code, await read_prefix(response)
        return 200, await read_capped(response, limit, what=what)
