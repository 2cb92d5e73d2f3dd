"""Real llama.cpp: a deployment on the console's own host (a Local node) answers a chat streamed through the
console's daphne, the model answers to its friendly name (`--alias`) on /v1/chat/completions, and the context
llama.cpp really used (capped at the model's trained one) is what the deployment stores and shows. On the
lab: a plan confirmed through the form with a remote coordinator listens on its LAN address and chats while a
worker's rpc-server holds layers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.urls import reverse

from deployments.endpoint import endpoint_url
from deployments.models import DeploymentState
from tests.chat_fixtures import ALIAS, ASKED_CTX, TRAINED_CTX, deploy, local_deployment, stop
from tests.deploy_fixtures import pid_alive
from tests.factories import UserFactory

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e, pytest.mark.timeout(900)]
MAX_TOKENS = 32


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
    # Starting and stopping on the console's own host is an admin's; chatting with it is an operator's.
    admin = UserFactory(username="alice-admin", role="admin")
    deployment = local_deployment(tmp_path, operator)
    try:
        deployment = deploy(deployment, admin, monkeypatch)
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
                reverse("chat:deployment", args=[deployment.pk]),
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
        deployment = stop(deployment, admin, monkeypatch)
    assert deployment.state == DeploymentState.STOPPED
    for info in deployment.processes.values():
        assert not pid_alive(int(info["pid"])), info


@pytest.mark.lab
@pytest.mark.timeout(1200)
def test_a_plan_confirmed_on_the_lab_listens_on_the_coordinators_address_and_chats_over_rpc(
    lab, lab_hosts, tmp_path, settings, monkeypatch, transactional_db
):
    """Two lab hosts over real sshd: the coordinator is not the console's host, so the confirm form's default
    endpoint is its LAN address; the console chats with it while a worker's rpc-server holds layers."""
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    from tests.deploy_fixtures import Cluster, lab_devices
    from tests.llamacpp_build import use_cached_llamacpp

    settings.RAMDECK_CHAT_MAX_TOKENS = MAX_TOKENS
    use_cached_llamacpp(settings)
    cluster = Cluster(lab, lab_hosts(2), tmp_path)
    cluster.build_all()
    model = cluster.model()
    lab_devices(cluster.coordinator, cluster.workers)
    type(cluster.coordinator).objects.update(rtt_ms=0.1)  # as the probe measures on the lab
    web = Client()
    web.force_login(cluster.operator)
    response = web.post(
        reverse("deployments:confirm", args=[model.pk]),
        {
            "ctx": 512,
            "parallel": 1,
            "cache_type": "f16",
            "clamp": 0.7,
            "coordinator": cluster.coordinator.pk,
            "nodes": [n.pk for n in cluster.nodes],
            "full": "1",
        },
    )
    assert response.status_code == 302, response.content.decode()[-3000:]
    deployment = model.deployments.get()
    assert (deployment.host, deployment.port) == (cluster.coordinator.address, 8080)
    assert any(p["endpoint"] for p in deployment.plan["placements"])  # the worker holds layers
    deployment = cluster.deploy(deployment, monkeypatch)
    try:
        assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
        assert endpoint_url(deployment) == f"http://{cluster.coordinator.address}:8080"

        async def ask():
            client = AsyncClient()
            await client.aforce_login(cluster.operator)
            answer = await client.post(
                reverse("chat:deployment", args=[deployment.pk]),
                data=json.dumps({"messages": [{"role": "user", "content": "hello"}]}),
                content_type="application/json",
            )
            assert answer.status_code == 200, answer.content
            return b"".join([chunk async for chunk in answer.streaming_content]).decode()

        text = async_to_sync(ask)()
        events = [json.loads(line[5:]) for line in text.split("\n") if line.startswith("data:")]
        # The lab's model has other random weights: its answer may be short; it must come, and no error.
        assert not [e for e in events if "error" in e] and events[-1]["done"] is True, events
        assert events[-1]["tokens"] >= 1
        assert deployment.api_key() not in text
    finally:
        deployment = cluster.stop(deployment, monkeypatch)
    cluster.assert_clean(deployment)
