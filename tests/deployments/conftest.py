"""Fixtures shared by the deployments app's tests."""

from __future__ import annotations

import asyncio

import pytest
from django.urls import reverse
from django.utils import timezone

from builds.models import Build, BuildSource
from deployments.lifecycle.actions import STEP_KINDS
from deployments.models import Deployment
from jobs.models import Job
from llamacpp import gguf as gguf_profile
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import DeviceKind, Transport
from tests.factories import DeviceFactory, NodeFactory

MIB = 2**20


@pytest.fixture
def deployment(operator_user):
    coordinator = NodeFactory(name="desk", may_coordinate=True)
    worker = NodeFactory(name="old-pc")
    for node in (coordinator, worker):
        Build.objects.create(
            node=node,
            source_kind=BuildSource.EXISTING,
            rpc_protocol="7.0.0",
            rpc_server_path="/opt/llama/ggml-rpc-server",
            llama_server_path="/opt/llama/llama-server",
        )
    model = ModelFile.objects.create(name="tiny", node=coordinator, path="/m/tiny.gguf")
    plan = {
        "fits": True,
        "predicted_tokens_per_s": 50.0,
        "baseline": {"predicted_tokens_per_s": 12.0},
        "placements": [
            {
                "node": "old-pc",
                "device": "CPU",
                "llama_device": "RPC0",
                "endpoint": f"{worker.address}:50052",
                "layers": 8,
                "output_layer": True,
                "weights_bytes": 1,
                "kv_bytes": 1,
                "compute_bytes": 1,
            },
        ],
        "llama_server_args": ["--rpc", f"{worker.address}:50052", "--device", "RPC0", "-ngl", "9"],
    }
    return Deployment.objects.create(
        name="tiny", model_file=model, coordinator=coordinator, plan=plan, created_by=operator_user
    )


@pytest.fixture
def no_enqueue(monkeypatch):
    """Jobs the test would send to a worker, as (kind, deployment pk); nothing is sent."""
    calls = []

    def send(job) -> bool:
        calls.append((job.kind, job.params.get("deployment")))
        return True

    monkeypatch.setattr(Job, "send_to_worker", send)
    return calls


@pytest.fixture
def steps(job_kind):
    """Replace every step kind's body: `steps(outcome)`, where outcome(job) returns the result line, raises
    JobFailed, or returns "wait" to run until cancelled."""
    ran: list[Job] = []

    def install(outcome):
        async def body(ctx) -> str:
            ran.append(ctx.job)
            answer = outcome(ctx.job)
            while answer == "wait":
                await asyncio.sleep(0.1)
            return answer

        for kind in set(STEP_KINDS.values()):
            job_kind(kind, body, needs_transport=False)
        return ran

    return install


@pytest.fixture
def gguf_path(tmp_path, settings):
    # Files on the console's own host are registered only from its model folders.
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path)]
    return write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama())


@pytest.fixture
def pool(db):
    """A coordinator (this console's host) with a small, slow CPU, and a faster worker on the LAN: room for
    the tiny model at 2048 tokens of context but not at the 4096 it was trained for (memory as llama.cpp
    sizes its buffers: with 24 MiB on the desk it fitted)."""
    now = timezone.now()
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=now)  # fmt: skip
    # Slow enough that a worker's RPC hop (the default 0.5 ms plus round trips) is worth paying.
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=20 * MIB, free_bytes=20 * MIB,
                  bandwidth_gbs=2)  # fmt: skip
    pc = NodeFactory(name="pc", address="10.77.0.2", rpc_port=50052, rtt_ms=0.3, last_seen_at=now)
    DeviceFactory(node=pc, name="CPU", kind=DeviceKind.CPU, total_bytes=14 * MIB, free_bytes=14 * MIB,
                  bandwidth_gbs=50)  # fmt: skip
    return {"desk": desk, "pc": pc}


@pytest.fixture
def model(pool, gguf_path, admin_client):
    # The console's own host (desk): registering a model there needs the admin role.
    response = admin_client.post(
        reverse("modelfiles:register"),
        {"name": "tiny", "node": pool["desk"].pk, "path": str(gguf_path)},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    return ModelFile.objects.get(name="tiny")


@pytest.fixture
def split_model(transactional_db, tmp_path):
    """A model the planner splits over two nodes (for browser tests: committed rows)."""
    now = timezone.now()
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=now)  # fmt: skip
    # Slow enough that a worker's RPC hop (the default 0.5 ms plus round trips) is worth paying.
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=24 * MIB, free_bytes=24 * MIB,
                  bandwidth_gbs=2)  # fmt: skip
    pc = NodeFactory(name="pc", address="10.77.0.2", rtt_ms=0.3, last_seen_at=now)
    DeviceFactory(node=pc, name="CPU", kind=DeviceKind.CPU, total_bytes=14 * MIB, free_bytes=14 * MIB,
                  bandwidth_gbs=50)  # fmt: skip
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama())
    profile = gguf_profile.profile_path(path)
    return ModelFile.objects.create(name="tiny", node=desk, path=str(path), profile=profile)
