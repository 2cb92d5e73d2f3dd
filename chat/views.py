"""Chat with a running deployment through the console.

The page posts the conversation so far (JSON); the console calls the deployment's llama-server at
`/v1/chat/completions` with `stream: true`, the model's friendly name (`--alias`) and the deployment's API
key, and streams the answer back to the page as server-sent events, chunk by chunk as llama.cpp produces them.
The API key is read and used here only: it never reaches the browser. The conversation lives in the page;
the console stores nothing of it and audits no message (what people ask their model is theirs).

Who may chat: operators and admins. Viewers look and change nothing; a chat spends the pool's compute and is
exactly what the API key grants, and viewers may not see that key either.

Events (`data: {json}` lines): {"delta": text}, {"reasoning": text} (a thinking model's reasoning),
{"error": message}, and last {"done": true, "finish_reason", "tokens", "tokens_per_s"}."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError
from django.http import JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from chat.relay import ChatInputError, _error_text, _json_or_text, event, parse_conversation, relay
from deployments.endpoint import endpoint_url
from deployments.models import Deployment, DeploymentState
from llamacpp.args import model_alias
from ramdeck_site.roles import CHAT, VIEWER, role_required
from remote.bounded_http import IDENTITY, MAX_ERROR_BYTES, AnswerTooLarge, capped_lines, read_prefix

logger = logging.getLogger(__name__)


# A degraded deployment may still answer (the monitor could not see every process): it is allowed to try.
# Verifying comes after the llama-server step saw GET /health answer 200 (deployments/steps/llama_server.py),
# so it already serves while the placement is checked and the speed measured (an answer then shares the
# model with the measurement and may come slower).
CHAT_STATES = (DeploymentState.VERIFYING, DeploymentState.RUNNING, DeploymentState.DEGRADED)


CONNECT_TIMEOUT_S = 10.0


# Between two chunks of the answer: the first token of a large model on a slow pool can take minutes.
READ_TIMEOUT_S = 600.0


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
@role_required(CHAT)
async def deployment_chat(request, pk: int):
    deployment, key = await sync_to_async(_load)(pk)
    if deployment.state not in CHAT_STATES:
        state = deployment.get_state_display().lower()
        return _refusal(f"{deployment.name} is {state}: chat works once llama-server answers.", 409)
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
    if settings.RAMDECK_CHAT_TEMPERATURE is not None:
        body["temperature"] = settings.RAMDECK_CHAT_TEMPERATURE
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


@role_required(VIEWER)
def chat_page(request, pk: int):
    """A deployment's chat on a page of its own, the conversation filling the window (a phone included).
    htmx polls its state badge (`#chat-state`), so the box opens once llama-server answers and closes
    when the deployment stops."""
    deployment = get_object_or_404(Deployment.objects.select_related("model_file"), pk=pk)
    context = {
        "deployment": deployment,
        "model_alias": model_alias(deployment.model_file.name),
        "standalone": True,
        "polling": deployment.state not in (DeploymentState.STOPPED, DeploymentState.FAILED),
    }
    template = "chat/page.html" + ("#state" if request.htmx else "")
    return render(request, template, context)
