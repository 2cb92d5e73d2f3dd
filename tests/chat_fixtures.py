"""A real deployment on the console's own host for the chat tests: the cached llama.cpp build registered on a
Local node, a small generated model under a friendly name, planned, deployed and stopped by the console's
own lifecycle (its jobs run in this process, not through a Celery worker)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from asgiref.sync import async_to_sync
from django.test import AsyncClient
from django.urls import reverse

from builds.models import Build
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from jobs.models import Job
from llamacpp.gguf import profile_path
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import Device, DeviceKind, Node, Transport
from planning import planner
from tests.llamacpp_build import require_llamacpp
from tests.runs import run_deployment, run_stop

MIB = 2**20
MODEL_NAME = "Family Tiny, v1"
ALIAS = "Family Tiny v1"  # llama-server's --alias splits at commas: the console keeps it one name
TRAINED_CTX = 256
ASKED_CTX = 512  # more than the model was trained on: llama.cpp caps each slot at 256
# Random weights from this seed almost never pick the end-of-text token early (measured here: 0 of 60 answers
# shorter than 48 tokens, where the default seed stops within 5 tokens about one time in four), so an answer
# is long enough to be seen arriving in pieces.
TALKATIVE_SEED = 42


def free_port() -> int:
    """A port nobody listens on now (other tests on this machine use 8080 and friends)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether an rpc-server could bind 127.0.0.1:`port` now: it sets SO_REUSEADDR, so only a live socket on
    the port keeps it from starting."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until_port_free(port: int, timeout: float = 60.0) -> None:
    """This machine's node calibrates on its RPC port (50052): an rpc-server an earlier test started there may
    still be ending (its stop runs in a worker), and a port held then fails the calibration, not the test."""
    deadline = time.monotonic() + timeout
    while not port_free(port):
        assert time.monotonic() < deadline, f"port {port} is still held by an earlier test's process"
        time.sleep(0.2)


def local_deployment(
    tmp_path: Path, user, *, trained: int = TRAINED_CTX, asked: int = ASKED_CTX
) -> Deployment:
    """A confirmed deployment of a small model (trained on `trained` tokens of context, planned with `asked`)
    on a Local node, on a free loopback port."""
    binaries = require_llamacpp()
    node = Node.objects.create(
        name="this-box", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True
    )
    Device.objects.create(node=node, name="CPU", kind=DeviceKind.CPU, total_bytes=4000 * MIB,
                          free_bytes=4000 * MIB, bandwidth_gbs=5.0)  # fmt: skip
    Build.objects.create(
        node=node,
        source_kind="existing",
        source=str(binaries.build_dir),
        rpc_protocol="7.0.0",
        build_dir=str(binaries.build_dir),
        rpc_server_path=str(binaries.rpc_server),
        llama_server_path=str(binaries.llama_server),
    )
    shape = TinyLlama(n_layer=4, n_embd=128, n_ctx_train=trained, seed=TALKATIVE_SEED)
    path = write_tiny_llama(tmp_path / "tiny.gguf", shape)
    profile = profile_path(path)
    model = ModelFile.objects.create(
        name=MODEL_NAME, node=node, path=str(path), size_bytes=profile["size_bytes"], profile=profile
    )
    devices = tuple(
        planner.Device(node.name, d.name, d.kind, d.total_bytes, d.free_bytes, d.bandwidth_gbs)
        for d in node.devices.all()
    )
    nodes = [planner.Node(node.name, node.address, devices, coordinator=True, rtt_ms=0.0)]
    plan = planner.plan(model.profile, nodes, planner.Settings(ctx=asked))
    assert plan["fits"], plan
    return Deployment.objects.create(
        name="tiny on this box",
        model_file=model,
        coordinator=node,
        plan=plan,
        plan_settings=plan["settings"],
        host="127.0.0.1",
        port=free_port(),
        created_by=user,
    )


def _not_sent(monkeypatch) -> None:
    """Jobs are run here by the test, not sent to a worker."""
    monkeypatch.setattr(Job, "send_to_worker", lambda job: True)


def deploy(deployment: Deployment, user, monkeypatch) -> Deployment:
    _not_sent(monkeypatch)
    started, message = lifecycle.start_deploy(deployment, user)
    assert started, message
    run_deployment(deployment.pk)
    deployment.refresh_from_db()
    return deployment


def stop(deployment: Deployment, user, monkeypatch) -> Deployment:
    _not_sent(monkeypatch)
    stopped, message = lifecycle.stop_deployment(deployment, user)
    assert stopped, message
    run_stop(deployment.pk)
    deployment.refresh_from_db()
    return deployment


KEY = "s3cret-key-of-the-deployment"


def chat_deployment(node, port: int, state=DeploymentState.RUNNING, name="tiny") -> Deployment:
    model = ModelFile.objects.create(name=name, node=node, path=f"/m/{name}.gguf")
    deployment = Deployment.objects.create(
        name=f"{name} deployment", model_file=model, coordinator=node, plan={}, port=port, state=state
    )
    deployment.store_api_key(KEY)
    return deployment


def post_chat(user, deployment, messages):
    """POST the conversation as `user` and read the whole answer, in one event loop (as under daphne)."""

    async def go():
        client = AsyncClient()
        await client.aforce_login(user)
        response = await client.post(
            reverse("chat:deployment", args=[deployment.pk]),
            data=json.dumps({"messages": messages}),
            content_type="application/json",
        )
        if response.streaming:
            response.body = b"".join([chunk async for chunk in response.streaming_content])
        return response

    return async_to_sync(go)()


def chat_events(response) -> list[dict]:
    text = response.body.decode()
    return [json.loads(line[5:]) for line in text.split("\n") if line.startswith("data:")]


def stand_in_llama_server(chunks: list[str], seen: list[dict], pause: float = 0.02) -> ThreadingHTTPServer:
    """Answers POST /v1/chat/completions with `chunks` as `data:` lines, a little apart, like llama-server."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                payload = (
                    b'{"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}'
                )
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for chunk in chunks:
                    self.wfile.write(f"data: {chunk}\n\n".encode())
                    self.wfile.flush()
                    seen[-1]["written"] = seen[-1].get("written", 0) + 1
                    time.sleep(pause)
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                seen[-1]["hung_up"] = True  # the console closed the connection: llama-server stops there
            self.close_connection = True

        def log_message(self, *args):
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def delta(text: str, finish=None, **extra) -> str:
    return json.dumps(
        {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}], **extra}
    )
