"""The chat's pure parts: a conversation read and checked, and llama-server's streamed answer relayed as
server-sent events (no Django here)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

ROLES = ("system", "user", "assistant")


MAX_MESSAGES = 200


MAX_CHARS = 200_000


class ChatInputError(ValueError):
    """The posted conversation is not one the console sends on; the message says why."""


def parse_conversation(body: bytes) -> list[dict[str, str]]:
    """The messages of a posted {"messages": [{"role", "content"}, ...]}, checked; the last is the user's."""
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError):
        raise ChatInputError("The chat request is not JSON.") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("The chat request carries no messages.")
    if len(messages) > MAX_MESSAGES:
        raise ChatInputError(
            f"The conversation is too long ({len(messages)} messages; at most {MAX_MESSAGES})."
        )
    clean, total = [], 0
    for message in messages:
        if not isinstance(message, dict):
            raise ChatInputError("Each message needs a role and a content.")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES or not isinstance(content, str):
            raise ChatInputError("Each message needs a role (system, user or assistant) and a text content.")
        total += len(content)
        clean.append({"role": role, "content": content})
    if total > MAX_CHARS:
        raise ChatInputError(f"The conversation is too long ({total} characters; at most {MAX_CHARS}).")
    if clean[-1]["role"] != "user" or not clean[-1]["content"].strip():
        raise ChatInputError("Type a message first.")
    return clean


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _error_text(data: Any) -> str:
    """llama-server's error, {"error": {"message": ...}} or {"error": "..."}, as one line."""
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        error = error.get("message") or json.dumps(error)
    return str(error)[:500]


async def relay(lines: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """llama-server's OpenAI-style stream (`data: {chunk}` lines, `data: [DONE]` last) as the page's
    events."""
    finish, tokens, speed = None, None, None
    async for line in lines:
        if line.startswith("error:"):
            yield event({"error": _error_text(_json_or_text(line[6:]))})
            return
        if not line.startswith("data:"):
            continue  # blank separators and comments
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = _json_or_text(data)
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            yield event({"error": _error_text(chunk)})
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield event({"reasoning": delta["reasoning_content"]})
            if delta.get("content"):
                yield event({"delta": delta["content"]})
            finish = choice.get("finish_reason") or finish
        # llama-server puts its timings on the last chunk; "usage" comes only when asked for.
        timings = chunk.get("timings") or {}
        tokens = (chunk.get("usage") or {}).get("completion_tokens", timings.get("predicted_n", tokens))
        speed = timings.get("predicted_per_second", speed)
    yield event({"done": True, "finish_reason": finish, "tokens": tokens, "tokens_per_s": speed})


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()
