"""Fixtures of the console-wide tests: the role matrix's small world of users, nodes, a deployment, a job."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit import history
from audit.models import AuditEvent
from deployments.models import Deployment, StaleProcess
from jobs.models import Job, JobState
from llamacpp import gguf as gguf_profile
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import CredentialKind, DeviceKind, Reachability, Transport
from tests.factories import CredentialFactory, DeviceFactory, NodeFactory, UserFactory
from tests.site.routes import ROLES


@pytest.fixture
def world(tmp_path):
    """Users in each role, a local and an SSH node with devices, a credential, a model with a confirmed
    deployment, a job, a stale process and an audit entry."""
    users = {role: UserFactory(username=f"matrix-{role}", role=role) for role in ROLES[1:]}
    now = timezone.now()
    credential = CredentialFactory(name="matrix-key", kind=CredentialKind.PASSWORD)
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=now, reachability=Reachability.REACHABLE)  # fmt: skip
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=2**30, free_bytes=2**30)
    attic = NodeFactory(
        name="attic",
        credential=credential,
        reachability=Reachability.HOST_KEY_PENDING,
        pending_host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMn0pQx8c9vF0rT4bW2yZ6uJ1kLhGdEs3",
        pending_host_key_fingerprint="SHA256:3f9TqZ0bV7yXw2LrKc8sMn5pHjDgA1eU6iO4lRtYvQk",
    )
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama())
    profile = gguf_profile.profile_path(path)
    model = ModelFile.objects.create(
        name="tiny", node=desk, path=str(path), size_bytes=profile["size_bytes"], profile=profile
    )
    client = Client()
    client.force_login(users["admin"])
    response = client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {"ctx": "512", "parallel": "1", "cache_type": "f16", "clamp": "0.7", "name": "tiny for the matrix"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.create(kind="command", node=desk, title="echo", state=JobState.RUNNING, started_at=now)
    job.append_lines([("out", "hello")])
    stale = StaleProcess.objects.create(node=attic, port=50052, pid=4242, program="ggml-rpc-server")
    history.record(users["admin"], "node.update", attic, changes={"notes": ["", "x"]})
    return {
        "users": users,
        "node": attic,
        "credential": credential,
        "model": model,
        "deployment": Deployment.objects.get(),
        "job": job,
        "stale": stale,
        "group": Group.objects.get(name="viewer"),
        "event": AuditEvent.objects.first(),
    }
