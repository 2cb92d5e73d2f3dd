"""Real llama.cpp: a deployment on the console's own host (a Local node) answers a chat streamed through the
console's daphne, the model answers to its friendly name (`--alias`) on /v1/chat/completions, and the context
llama.cpp really used (capped at the model's trained one) is what the deployment stores and shows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.urls import reverse

from deployments.lifecycle_steps import endpoint_url
from deployments.models import DeploymentState
from tests.chat_fixtures import ALIAS, ASKED_CTX, TRAINED_CTX, deploy, local_deployment, stop
from tests.deploy_fixtures import pid_alive
from tests.factories import UserFactory

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e, pytest.mark.timeout(900)]
MAX_TOKENS = 8


@pytest.fixture
def short_answers(settings):
    """Set before the live server forks, so it answers with at most MAX_TOKENS tokens."""
    settings.RAMDECK_CHAT_MAX_TOKENS = MAX_TOKENS


def _session(user) -> dict[str, str]:
    client = Client()
    client.force_login(user)
    name = django_settings.SESSION_COOKIE_NAME
    return {name: client.cookies[name].value}


def test_a_deployment_on_this_box_answers_a_chat_streamed_through_the_console(
    short_answers, live_server_url, tmp_path, monkeypatch
):
    operator = UserFactory(username="oscar-operator", role="operator")
    deployment = local_deployment(tmp_path, operator)
    try:
        deployment = deploy(deployment, operator, monkeypatch)
        assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
        server = deployment.processes[f"llama-server@{deployment.coordinator.name}"]
        argv = Path(f"/proc/{server['pid']}/cmdline").read_bytes().split(b"\0")
        at = argv.index(b"--alias")
        assert argv[at : at + 6] == [
            b"--alias", ALIAS.encode(), b"--host", b"127.0.0.1", b"--port", str(deployment.port).encode()
        ]  # fmt: skip

        # The context llama.cpp used, not the one asked for, is stored and shown (with the asked one beside).
        assert deployment.ctx_used == TRAINED_CTX and deployment.ctx_requested == ASKED_CTX
        assert deployment.verification["context"]["capped"] is True
        cookies = _session(operator)
        with httpx.Client(base_url=live_server_url, cookies=cookies, timeout=60) as web:
            detail = web.get(reverse("deployments:detail", args=[deployment.pk])).text
            assert f'<span id="context-used">{TRAINED_CTX} <span class="badge warn"' in detail
            assert f"requested {ASKED_CTX}" in detail and "trained context (256)" in detail

        # The friendly name works on llama-server's OpenAI-style API, with the key.
        url, key = endpoint_url(deployment), deployment.api_key()
        auth = {"Authorization": f"Bearer {key}"}
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == [ALIAS]
        direct = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": ALIAS, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
            headers=auth,
            timeout=300,
        )
        assert direct.status_code == 200, direct.text
        assert direct.json()["model"] == ALIAS and direct.json()["usage"]["completion_tokens"] > 0

        # Through the console: the browser's session, no key; the answer arrives in pieces as it is written.
        with httpx.Client(base_url=live_server_url, cookies=cookies, timeout=300) as web:
            page = web.get(reverse("deployments:run", args=[deployment.pk]))
            assert page.status_code == 200 and 'id="chat-form"' in page.text and key not in page.text
            messages = [{"role": "user", "content": "Tell me about the fox."}]
            reads: list[float] = []
            raw = b""
            with web.stream(
                "POST",
                reverse("deployments:chat", args=[deployment.pk]),
                json={"messages": messages},
                headers={"X-CSRFToken": web.cookies["csrftoken"]},
            ) as response:
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/event-stream"
                for chunk in response.iter_raw():
                    reads.append(time.monotonic())
                    raw += chunk
        text = raw.decode()
        assert key not in text
        events = [json.loads(line[5:]) for line in text.split("\n") if line.startswith("data:")]
        deltas = [e["delta"] for e in events if "delta" in e]
        assert not [e for e in events if "error" in e], events
        assert len(deltas) >= 2 and "".join(deltas)
        assert events[-1]["done"] is True and 0 < events[-1]["tokens"] <= MAX_TOKENS
        assert events[-1]["finish_reason"] in ("length", "stop")
        # Streamed: the events came in more than one read, spread over the generation.
        assert len(reads) >= 2, text
        print(f"\nCHAT {len(deltas)} deltas in {len(reads)} reads over {reads[-1] - reads[0]:.2f} s")
    finally:
        deployment = stop(deployment, operator, monkeypatch)
    assert deployment.state == DeploymentState.STOPPED
    for info in deployment.processes.values():
        assert not pid_alive(int(info["pid"])), info
