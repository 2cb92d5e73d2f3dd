"""A node's RPC cache: its panel on the node page, Clear (operators, confirmed, audited, refused while a
deployment uses the node), the size limit, and the script run for real on the console's own host against
files in a cache folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from deployments.models import Deployment, DeploymentState, ResourceClaim
from jobs.models import Job, JobState
from llamacpp import rpc_cache
from modelfiles.models import ModelFile
from nodes.forms import NodeForm
from nodes.models import Node
from tests.deploy_fixtures import log_text, run
from tests.factories import CredentialFactory, NodeFactory

GIB = 1024**3


def _in_use(node: Node) -> Deployment:
    model = ModelFile.objects.create(name="m", node=node, path="/m.gguf", profile={})
    deployment = Deployment.objects.create(
        name="family-chat", model_file=model, coordinator=node, plan={}, state=DeploymentState.RUNNING
    )
    ResourceClaim.objects.create(node=node, resource="port:50052", deployment=deployment)
    return deployment


@pytest.mark.django_db
def test_the_node_page_shows_the_cache_size_free_disk_and_limit(viewer_client):
    node = NodeFactory(
        name="old-pc",
        rpc_cache_state={
            "dir": "/home/u/.cache/llama.cpp/rpc",
            "entries": 3,
            "bytes": 3 * GIB,
            "free_bytes": 40 * GIB,
            "read_at": "2026-12-05T04:00:00+00:00",
        },
    )
    page = viewer_client.get(node.get_absolute_url()).content.decode()
    assert "RPC cache" in page and "3.0 GiB in 3 entries" in page and "40.0 GiB" in page
    assert f"{rpc_cache.DEFAULT_LIMIT_GIB} GiB" in page and "/home/u/.cache/llama.cpp/rpc" in page
    # A viewer is offered neither button.
    assert reverse("nodes:rpc_cache_clear", args=[node.name]) not in page


@pytest.mark.django_db
def test_a_viewer_cannot_clear_or_read_a_cache(viewer_client):
    node = NodeFactory(name="old-pc")
    assert viewer_client.post(reverse("nodes:rpc_cache_clear", args=[node.name])).status_code == 403
    assert viewer_client.post(reverse("nodes:rpc_cache_read", args=[node.name])).status_code == 403
    assert not Job.objects.filter(kind="rpc_cache").exists()


@pytest.mark.django_db(transaction=True)
def test_an_operator_is_asked_to_confirm_then_clears_with_an_audit_entry(operator_client):
    node = NodeFactory(name="old-pc")
    page = operator_client.get(node.get_absolute_url()).content.decode()
    assert reverse("nodes:rpc_cache_clear", args=[node.name]) in page
    confirm = operator_client.get(reverse("nodes:rpc_cache_clear", args=[node.name])).content.decode()
    assert "RPC cache?</h1>" in confirm and "sends its weights over the network again" in confirm
    assert not Job.objects.filter(kind="rpc_cache").exists()  # asking is not doing
    response = operator_client.post(reverse("nodes:rpc_cache_clear", args=[node.name]))
    job = Job.objects.get(kind="rpc_cache")
    assert response.status_code == 302 and response.url == job.get_absolute_url()
    assert job.params == {"action": "clear"} and job.node == node
    event = AuditEvent.objects.get(action="node.rpc_cache.clear")
    assert event.actor_name == "oscar-operator" and event.changes == {"job": job.pk}


@pytest.mark.django_db(transaction=True)
def test_clear_is_refused_with_the_reason_while_a_deployment_uses_the_node(operator_client):
    node = NodeFactory(name="old-pc")
    _in_use(node)
    confirm = operator_client.get(reverse("nodes:rpc_cache_clear", args=[node.name])).content.decode()
    assert "in use by deployment family-chat" in confirm and "Clear the RPC cache</button>" not in confirm
    response = operator_client.post(reverse("nodes:rpc_cache_clear", args=[node.name]), follow=True)
    assert "in use by deployment family-chat: stop it first" in response.content.decode()
    assert not Job.objects.filter(kind="rpc_cache").exists()
    refused = AuditEvent.objects.get(action="node.rpc_cache.clear_refused")
    assert "family-chat" in refused.changes["why"]


@pytest.mark.django_db
def test_an_operator_may_not_clear_the_console_hosts_cache(operator_client, admin_user):
    node = NodeFactory(name="console-host", address="127.0.0.1", transport="local")
    response = operator_client.post(reverse("nodes:rpc_cache_clear", args=[node.name]))
    assert response.status_code == 403 and not Job.objects.filter(kind="rpc_cache").exists()
    operator_client.force_login(admin_user)
    assert operator_client.post(reverse("nodes:rpc_cache_clear", args=[node.name])).status_code == 302


@pytest.mark.django_db
def test_the_cache_folder_must_be_absolute_and_the_limit_a_whole_number(admin_user):
    node = NodeFactory(name="old-pc", credential=CredentialFactory())
    assert node.rpc_cache_limit_gib == rpc_cache.DEFAULT_LIMIT_GIB and node.llama_cache_dir == ""
    data = {
        "name": "old-pc",
        "address": node.address,
        "transport": "ssh",
        "ssh_port": 22,
        "ssh_user": "root",
        "credential": node.credential.pk,
        "rpc_port": 50052,
        "platform_hint": "auto",
        "enabled": "on",
        "rpc_cache_limit_gib": 8,
    }
    form = NodeForm({**data, "llama_cache_dir": "cache/llama"}, instance=node)
    assert not form.is_valid() and "must be an absolute path" in str(form.errors["llama_cache_dir"])
    form = NodeForm({**data, "llama_cache_dir": "/srv/llama\ncache"}, instance=node)
    assert not form.is_valid() and "control character" in str(form.errors["llama_cache_dir"])
    form = NodeForm({**data, "rpc_cache_limit_gib": "-1", "llama_cache_dir": ""}, instance=node)
    assert not form.is_valid() and "rpc_cache_limit_gib" in form.errors
    form = NodeForm({**data, "llama_cache_dir": "/srv/llama"}, instance=node)
    assert form.is_valid(), form.errors
    assert form.save().llama_cache_dir == "/srv/llama"


@pytest.mark.django_db
def test_the_cache_folder_is_a_path_of_the_nodes_own_platform():
    node = NodeFactory(name="gaming-pc", credential=CredentialFactory())
    data = {
        "name": "gaming-pc",
        "address": node.address,
        "transport": "ssh",
        "ssh_port": 22,
        "ssh_user": "ramdeck",
        "credential": node.credential.pk,
        "rpc_port": 50052,
        "enabled": "on",
        "rpc_cache_limit_gib": 8,
    }
    windows = {**data, "platform_hint": "windows"}
    form = NodeForm({**windows, "llama_cache_dir": "D:\\llama cache"}, instance=node)
    assert form.is_valid(), form.errors
    form = NodeForm({**windows, "llama_cache_dir": "/srv/llama"}, instance=node)
    assert not form.is_valid() and "on a drive" in str(form.errors["llama_cache_dir"])
    form = NodeForm({**data, "platform_hint": "linux", "llama_cache_dir": "D:\\llama"}, instance=node)
    assert not form.is_valid() and "starting with /" in str(form.errors["llama_cache_dir"])
    # Not known yet (Detect): either form, checked again by the job against the shell that answers.
    form = NodeForm({**data, "platform_hint": "auto", "llama_cache_dir": "D:\\llama"}, instance=node)
    assert form.is_valid(), form.errors


def test_the_server_command_turns_the_cache_on_and_names_its_folder_through_env():
    args = ["-H", "127.0.0.1", "-p", "50052"]
    assert rpc_cache.server_argv("/b/ggml-rpc-server", args) == ["/b/ggml-rpc-server", *args, "-c"]
    hostile = "/srv/$(touch /tmp/owned) x;y"
    assert rpc_cache.server_argv("/b/ggml-rpc-server", args, hostile) == [
        "env",
        f"LLAMA_CACHE={hostile}",
        "/b/ggml-rpc-server",
        *args,
        "-c",
    ]
    with pytest.raises(rpc_cache.CacheError, match="absolute"):
        rpc_cache.server_argv("/b/ggml-rpc-server", args, "-rf")


def test_a_node_whose_limit_is_0_starts_rpc_server_without_its_cache():
    args = ["-H", "10.0.0.2", "-p", "50052", "-c", "-t", "4"]  # an older plan's args still carrying -c
    kept = rpc_cache.start_argv("/b/ggml-rpc-server", args, limit_gib=32, folder="/srv/llama")
    assert kept == [
        "env",
        "LLAMA_CACHE=/srv/llama",
        "/b/ggml-rpc-server",
        "-H",
        "10.0.0.2",
        "-p",
        "50052",
    ] + [
        "-t",
        "4",
        "-c",
    ]
    off = rpc_cache.start_argv("/b/ggml-rpc-server", args, limit_gib=0, folder="/srv/llama")
    assert off == ["/b/ggml-rpc-server", "-H", "10.0.0.2", "-p", "50052", "-t", "4"]


def test_a_windows_node_starts_rpc_server_with_its_cache_and_its_own_folder_through_the_start():
    args = ["-H", "10.0.0.2", "-p", "50052"]
    default = rpc_cache.start_argv(r"C:\llama\rpc-server.exe", args, limit_gib=32, windows=True)
    assert default == [r"C:\llama\rpc-server.exe", *args, "-c"]
    own = rpc_cache.launch_argv(
        r"C:\llama\rpc-server.exe", args, limit_gib=32, folder="D:/llama cache/", platform="windows"
    )
    # `env` words the Windows start turns into $env: settings (remote/powershell.py split_env).
    assert own == ["env", r"LLAMA_CACHE=D:\llama cache", r"C:\llama\rpc-server.exe", *args, "-c"]
    with pytest.raises(rpc_cache.CacheError, match="on a drive"):
        rpc_cache.start_argv("x.exe", args, limit_gib=32, folder="/srv/llama", windows=True)


def _entries(folder: Path, sizes: list[int]) -> list[Path]:
    """Cache entries as rpc-server writes them, the first the oldest."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    paths = []
    for i, size in enumerate(sizes):
        path = folder / f"{i + 1:016x}"
        path.write_bytes(os.urandom(size))
        os.utime(path, (now - 1000 + i * 10, now - 1000 + i * 10))
        paths.append(path)
    return paths


@pytest.mark.django_db(transaction=True)
def test_read_and_clear_run_for_real_and_leave_other_files_alone(local_node, tmp_path):
    # A hostile-looking folder: taken as one literal path, never run.
    base = tmp_path / "cache $(touch owned) ;x"
    local_node.llama_cache_dir = str(base)
    local_node.save()
    entries = _entries(base / "rpc", [100_000, 200_000, 300_000])
    (base / "rpc" / "notes.txt").write_text("mine")
    (base / "rpc" / "00000000000000ff").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text("not the cache's")
    read = run(Job.objects.create(kind="rpc_cache", node=local_node, params={"action": "usage"}))
    assert read.state == JobState.SUCCEEDED, log_text(read)
    local_node.refresh_from_db()
    state = local_node.rpc_cache_state
    assert state["entries"] == 3 and state["bytes"] == 600_000 and state["dir"] == str(base / "rpc")
    assert state["free_bytes"] > 0
    clear = run(Job.objects.create(kind="rpc_cache", node=local_node, params={"action": "clear"}))
    assert clear.state == JobState.SUCCEEDED, log_text(clear)
    assert clear.result.startswith("cleared 3 entries")
    assert not any(p.exists() for p in entries)
    assert (base / "rpc" / "notes.txt").exists() and (tmp_path / "elsewhere").read_text() == "not the cache's"
    assert not list(Path.cwd().glob("owned")) and not (tmp_path / "owned").exists()
    local_node.refresh_from_db()
    assert local_node.rpc_cache_state["bytes"] == 0


@pytest.mark.django_db(transaction=True)
def test_the_clear_job_itself_refuses_when_a_deployment_started_since_the_button(local_node, tmp_path):
    local_node.llama_cache_dir = str(tmp_path)
    local_node.save()
    entries = _entries(tmp_path / "rpc", [1000])
    _in_use(local_node)
    job = run(Job.objects.create(kind="rpc_cache", node=local_node, params={"action": "clear"}))
    assert job.state == JobState.FAILED and "in use by deployment family-chat" in job.result
    assert entries[0].exists()


@pytest.mark.django_db(transaction=True)
def test_trimming_removes_the_oldest_entries_first_down_to_the_limit(local_node, tmp_path):
    import asyncio

    from nodes import cache
    from nodes.transports import transport_for
    from tests.deploy_fixtures import StepContext

    local_node.llama_cache_dir = str(tmp_path)
    local_node.rpc_cache_limit_gib = 1
    local_node.save()
    oldest, middle, newest = _entries(tmp_path / "rpc", [400_000, 300_000, 200_000])
    ctx = StepContext({}, node=local_node, transport=transport_for(local_node))
    # Under the limit: nothing goes.
    asyncio.run(cache.trim_before_start(ctx, local_node))
    assert oldest.exists() and middle.exists() and newest.exists()
    found = asyncio.run(cache.run_script(ctx, local_node, "trim", 550_000))
    assert found["removed"] == [(oldest.name, 400_000)] and found["bytes"] == 500_000
    assert not oldest.exists() and middle.exists() and newest.exists()
    found = asyncio.run(cache.run_script(ctx, local_node, "trim", 250_000))
    assert [name for name, _ in found["removed"]] == [middle.name] and newest.exists()
    assert any("removed 1 entries" in line for line in ctx.lines)


@pytest.mark.django_db(transaction=True)
def test_a_probe_reads_the_cache_for_the_node_page(local_node, tmp_path, admin_client):
    local_node.llama_cache_dir = str(tmp_path)
    local_node.save()
    _entries(tmp_path / "rpc", [5000, 7000])
    probe = run(Job.objects.create(kind="probe", node=local_node))
    assert probe.state == JobState.SUCCEEDED, log_text(probe)[-2000:]
    local_node.refresh_from_db()
    assert local_node.rpc_cache_state["entries"] == 2 and local_node.rpc_cache_state["bytes"] == 12_000
    page = admin_client.get(local_node.get_absolute_url()).content.decode()
    assert "11.7 KiB in 2 entries" in page
