"""Chat with a running deployment through the console.

The page posts the conversation so far (JSON); the console calls the deployment's llama-server at
`/v1/chat/completions` with `stream: true`, the model's friendly name (`--alias`) and the deployment's API
key, and streams the answer back to the page as server-sent events, chunk by chunk as llama.cpp produces them.
The API key is read and used here only: it never reaches the browser. The conversation lives in the page;
the console stores nothing of it and audits no message (what people ask their model is theirs).

Who may chat: operators and admins. Viewers look and change nothing; a chat spends the pool's compute and is
exactly what the API key grants, and viewers may not see that key either.

Events (`data: {json}` lines): {"delta": text}, {"reasoning": text} (a thinking model's reasoning),
{"error": message}, and last {"done": true, "finish_reason", "tokens", "tokens_per_s"}.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError
from django.http import JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.views.decorators.http import require_POST

from ramdeck_site.roles import OPERATOR, role_required

from .bounded_http import IDENTITY, MAX_ERROR_BYTES, AnswerTooLarge, capped_lines, read_prefix
from .lifecycle_steps import endpoint_url
from .llamacpp import model_alias
from .models import Deployment, DeploymentState

logger = logging.getLogger(__name__)

# A degraded deployment may still answer (the monitor could not see every process): it is allowed to try.
CHAT_STATES = (DeploymentState.RUNNING, DeploymentState.DEGRADED)
ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 200
MAX_CHARS = 200_000
CONNECT_TIMEOUT_S = 10.0
# Between two chunks of the answer: the first token of a large model on a slow pool can take minutes.
READ_TIMEOUT_S = 600.0


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


def _load(pk: int) -> tuple[Deployment, str]:
    deployment = get_object_or_404(Deployment.objects.select_related("coordinator", "model_file"), pk=pk)
    key = deployment.api_key() if deployment.api_key_encrypted else ""
    return deployment, key


def _refusal(message: str, status: int) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


# How `event` starts a piece of the model's answer.
ANSWER_EVENT = b'data: {"delta"'


def _note_first_answer(pk: int) -> None:
    """The first answer the chat box got from this deployment (the first-run checklist's "chat" step). A
    tick of the checklist never breaks a chat: a database that does not answer just leaves it for later."""
    try:
        Deployment.objects.filter(pk=pk, chat_answered_at__isnull=True).update(
            chat_answered_at=timezone.now()
        )
    except DatabaseError:
        logger.warning("Could not note deployment %s's first chat answer", pk, exc_info=True)


async def _stream(client: httpx.AsyncClient, upstream: httpx.Response, pk: int) -> AsyncIterator[bytes]:
    """The answer, relayed; the connection to llama-server is closed when the page goes away, too (the
    server then stops generating)."""
    answered = False
    try:
        # Line by line, each at most MAX_LINE_BYTES: an endless line is not held for the whole of it.
        async for chunk in relay(capped_lines(upstream)):
            yield chunk
            if not answered and chunk.startswith(ANSWER_EVENT):
                # After the first piece is on its way, so the write never delays it.
                answered = True
                await sync_to_async(_note_first_answer)(pk)
    except httpx.HTTPError as exc:
        yield event({"error": f"The connection to llama-server broke: {exc or type(exc).__name__}"})
    except AnswerTooLarge as exc:
        yield event({"error": f"{exc}; the answer stops here."})
    finally:
        await upstream.aclose()
        await client.aclose()


@require_POST
@role_required(OPERATOR)
async def deployment_chat(request, pk: int):
    deployment, key = await sync_to_async(_load)(pk)
    if deployment.state not in CHAT_STATES:
        state = deployment.get_state_display().lower()
        return _refusal(f"{deployment.name} is {state}: chat works while it is running.", 409)
    if not key:
        return _refusal(f"{deployment.name} has no API key on record: restart it.", 409)
    try:
        messages = parse_conversation(request.body)
    except ChatInputError as exc:
        return _refusal(str(exc), 400)
    url = endpoint_url(deployment)
    body = {
        "model": model_alias(deployment.model_file.name),
        "messages": messages,
        "stream": True,
        "max_tokens": settings.RAMDECK_CHAT_MAX_TOKENS,
    }
    client = httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
    request_up = client.build_request(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", **IDENTITY},
    )
    try:
        upstream = await client.send(request_up, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        return _refusal(f"llama-server at {url} did not answer: {exc or type(exc).__name__}", 502)
    if upstream.status_code != 200:
        try:
            # Its first bytes only: the reason is a line, whatever size the body claims to be.
            text = (await read_prefix(upstream, MAX_ERROR_BYTES)).decode(errors="replace")
        except httpx.HTTPError:
            text = ""
        finally:
            await upstream.aclose()
            await client.aclose()
        reason = _error_text(_json_or_text(text)) or upstream.reason_phrase
        return _refusal(f"llama-server answered {upstream.status_code}: {reason}", 502)
    answer = _stream(client, upstream, deployment.pk)
    response = StreamingHttpResponse(answer, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a reverse proxy in front of the console must not hold it back
    return response
