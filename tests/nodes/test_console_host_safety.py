"""The console's own host (a Local-transport node): only admins get work done there, whatever the job kind and
whichever view or task creates it; its subprocesses inherit none of the console's secrets."""

from __future__ import annotations

import asyncio
import os

import pytest
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent
from builds.models import Build, BuildSource
from deployments.models import Deployment, DeploymentState, StaleProcess
from jobs import kinds
from jobs.models import Job, LocalNodeRefused
from modelfiles.models import ModelFile
from nodes.models import Transport
from remote.local import LocalTransport
from tests.factories import NodeFactory

pytestmark = [pytest.mark.security, pytest.mark.django_db]


@pytest.fixture
def console_host(db):
    return NodeFactory(
        name="console-host", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True
    )


@pytest.fixture
def remote(db):
    return NodeFactory(name="old-pc", address="10.77.1.2")


@pytest.fixture
def no_enqueue(monkeypatch):
    sent = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: sent.append(job.pk) or True)
    return sent


# --------------------------------------------------------------------------------------------------
# Where jobs are created: every kind


def test_every_registered_job_kind_is_refused_to_an_operator_on_the_console_host(console_host, operator_user):
    assert len(kinds.names()) >= 10  # the apps registered theirs: the test covers each of them
    for kind in kinds.names():
        with pytest.raises(LocalNodeRefused, match="console's own host, need the admin role"):
            Job.objects.create(kind=kind, node=console_host, title=kind, created_by=operator_user)
    assert not Job.objects.exists()


def test_every_kind_is_allowed_to_an_admin_and_to_the_console_itself(console_host, admin_user):
    for kind in kinds.names():
        Job.objects.create(kind=kind, node=console_host, title=kind, created_by=admin_user)
        Job.objects.create(kind=kind, node=console_host, title=kind, created_by=None)
    assert Job.objects.count() == 2 * len(kinds.names())


def test_an_operator_still_runs_every_kind_on_a_remote_node(remote, operator_user):
    for kind in kinds.names():
        Job.objects.create(kind=kind, node=remote, title=kind, created_by=operator_user)
    assert Job.objects.count() == len(kinds.names())


def test_a_model_on_the_console_host_is_refused_to_an_operator(
    console_host, remote, operator_user, admin_user
):
    with pytest.raises(LocalNodeRefused):
        ModelFile.objects.create(name="m", node=console_host, path="/m/a.gguf", created_by=operator_user)
    ModelFile.objects.create(name="m", node=console_host, path="/m/a.gguf", created_by=admin_user)
    ModelFile.objects.create(name="r", node=remote, path="/m/a.gguf", created_by=operator_user)


# --------------------------------------------------------------------------------------------------
# Every view that starts work: a 403 that says why, and an audit entry


def _refused(response, console_host) -> None:
    assert response.status_code == 403
    assert "the console&#x27;s own host" in response.content.decode()
    event = AuditEvent.objects.filter(action="permission_denied").latest("pk")
    assert event.changes["local_node"] is True and event.object_repr == console_host.name
    assert not Job.objects.exists()


def test_probe_calibrate_build_and_reap_views_refuse_an_operator(console_host, operator_client, no_enqueue):
    name = console_host.name
    _refused(operator_client.post(reverse("nodes:probe", args=[name])), console_host)
    _refused(operator_client.post(reverse("calibration:node", args=[name])), console_host)
    build = {"source": "existing", "existing_dir": "/opt/llama", "backend": "auto"}
    _refused(operator_client.post(reverse("builds:start", args=[name]), build), console_host)
    stale = StaleProcess.objects.create(node=console_host, program="ggml-rpc-server", pid=4242, port=50052)
    _refused(operator_client.post(reverse("deployments:stale_reap", args=[stale.pk])), console_host)
    assert no_enqueue == []


def test_the_probe_view_works_for_an_admin(console_host, admin_client, no_enqueue):
    response = admin_client.post(reverse("nodes:probe", args=[console_host.name]))
    assert response.status_code == 302
    assert Job.objects.get().node == console_host


def test_calibrate_all_skips_the_console_host_for_an_operator(
    console_host, remote, operator_client, no_enqueue
):
    from nodes.models import Device

    for node in (console_host, remote):
        Build.objects.create(node=node, source_kind=BuildSource.EXISTING, rpc_protocol="7.0.0")
        Device.objects.create(node=node, kind="cpu", name="CPU", total_bytes=2**30, free_bytes=2**30)
    response = operator_client.post(reverse("calibration:all"), follow=True)
    assert [job.node for job in Job.objects.all()] == [remote]
    assert "Not calibrated: console-host" in response.content.decode()


def test_command_download_and_register_views_refuse_an_operator(console_host, operator_client, no_enqueue):
    command = {"node": console_host.name, "command": "id"}
    assert operator_client.post(reverse("run_command"), command).status_code == 403
    download = {
        "download-url": "https://example.org/m.gguf",
        "download-node": console_host.pk,
        "download-dest": "/tmp/m.gguf",
    }
    _refused(operator_client.post(reverse("modelfiles:download"), download), console_host)
    register = {"name": "m", "node": console_host.pk, "path": "/etc/passwd"}
    _refused(operator_client.post(reverse("modelfiles:register"), register), console_host)
    assert not ModelFile.objects.exists()


def _deployment(console_host, remote, created_by) -> Deployment:
    for node in (console_host, remote):
        Build.objects.create(
            node=node,
            source_kind=BuildSource.EXISTING,
            rpc_protocol="7.0.0",
            rpc_server_path="/opt/llama/ggml-rpc-server",
            llama_server_path="/opt/llama/llama-server",
        )
    model = ModelFile.objects.create(name="tiny", node=console_host, path="/m/tiny.gguf")
    plan = {
        "fits": True,
        "llama_server_args": ["--rpc", "10.77.1.2:50052", "--device", "RPC0"],
        "placements": [
            {"node": remote.name, "device": "CPU", "endpoint": "10.77.1.2:50052", "layers": 6},
            {"node": console_host.name, "device": "CPU", "endpoint": None, "layers": 2, "output_layer": True},
        ],
    }
    return Deployment.objects.create(
        name="tiny", model_file=model, coordinator=console_host, plan=plan, created_by=created_by
    )


def test_deploy_stop_and_redeploy_on_the_console_host_need_an_admin(
    console_host, remote, operator_user, operator_client, admin_user, no_enqueue
):
    deployment = _deployment(console_host, remote, created_by=operator_user)
    page = reverse("deployments:run", args=[deployment.pk])
    response = operator_client.post(reverse("deployments:deploy", args=[deployment.pk]), follow=True)
    assert "console-host is the console&#x27;s own host" in response.content.decode()
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.CONFIRMED and not Job.objects.exists()
    assert AuditEvent.objects.filter(action="deployment.refused").exists()

    # An admin deploys the operator's confirmed plan: the run and its steps are the admin's.
    from deployments.lifecycle.actions import start_deploy

    assert start_deploy(deployment, admin_user)[0] is True
    assert set(Job.objects.values_list("created_by", flat=True)) == {admin_user.pk}
    before = Job.objects.count()
    response = operator_client.post(
        reverse("deployments:stop", args=[deployment.pk]), {"confirm": "yes"}, follow=True
    )
    assert response.redirect_chain[-1][0] == page
    assert "needs the admin" in response.content.decode() and Job.objects.count() == before

    # A run the console starts itself (a rollback) for an operator's deployment is the console's own.
    from deployments.lifecycle.actions import start_undeploy

    run = start_undeploy(deployment, fail={"step": "verify", "reason": "test"})
    assert run.created_by is None


def test_an_operator_still_deploys_on_remote_nodes_only(remote, operator_user, no_enqueue):
    from deployments.lifecycle.actions import start_deploy

    coordinator = NodeFactory(name="desk", may_coordinate=True)
    deployment = _deployment(coordinator, remote, created_by=operator_user)
    assert start_deploy(deployment, operator_user)[0] is True
    assert set(Job.objects.values_list("created_by", flat=True)) == {operator_user.pk}


# --------------------------------------------------------------------------------------------------
# The environment of local subprocesses


def test_local_commands_and_daemons_get_a_scrubbed_environment(monkeypatch, tmp_path):
    # Values no environment holds by chance (a two-letter "pw" was found inside a random temporary name).
    leaked = {
        "RAMDECK_ENCRYPTION_KEYS": "leaked-fernet-key-4f1d",
        "RAMDECK_SECRET_KEY": "django-secret",
        "DATABASE_URL": "postgres://ramdeck:leaked-db-pw-4f1d@127.0.0.1/ramdeck",
        "REDIS_URL": "redis://:leaked-redis-pw-4f1d@127.0.0.1:6379/0",
        "SOME_API_TOKEN": "leaked-t0ken-4f1d",
        "HF_PASSWORD": "leaked-hf-pw-4f1d",
        "AWS_SECRET_ACCESS_KEY": "leaked-aws-4f1d",
    }
    for name, value in leaked.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LANG", "C.UTF-8")

    async def run():
        async with LocalTransport(command_timeout=30) as local:
            result = await local.run(["env"])
            log = tmp_path / "daemon.log"
            pid = await local.start_daemon(["sh", "-c", "env; sleep 30"], log_path=str(log))
            for _ in range(100):
                if "PATH=" in (log.read_text() if log.exists() else ""):
                    break
                await asyncio.sleep(0.05)
            await local.kill(pid, grace=1)
            return result.stdout, log.read_text()

    command_env, daemon_env = asyncio.run(run())
    for text in (command_env, daemon_env):
        names = {line.split("=", 1)[0] for line in text.splitlines() if "=" in line}
        assert not names & set(leaked), names & set(leaked)
        assert not any(name.startswith("RAMDECK_") for name in names)
        assert "PATH" in names and "LANG" in names  # what programs need is kept
        for value in leaked.values():
            assert value not in text
    assert os.environ["RAMDECK_SECRET_KEY"] == "django-secret"  # the console's own is untouched


def test_the_model_forms_offer_the_console_host_to_admins_only(
    console_host, remote, client, operator_user, admin_user
):
    client.force_login(operator_user)
    page = client.get(reverse("modelfiles:list")).content.decode()
    assert f'<option value="{remote.pk}">' in page and f'<option value="{console_host.pk}">' not in page
    client.force_login(admin_user)
    page = client.get(reverse("modelfiles:list")).content.decode()
    assert f'<option value="{console_host.pk}">' in page


# --------------------------------------------------------------------------------------------------
# A deployment that uses the console's host: its API key, RPC mode and self-healing are the admins'


def test_the_api_key_rpc_mode_and_self_healing_of_a_console_host_deployment_need_an_admin(
    console_host, remote, operator_user, admin_user
):
    operator_client, admin_client = Client(), Client()
    operator_client.force_login(operator_user)
    admin_client.force_login(admin_user)
    deployment = _deployment(console_host, remote, created_by=admin_user)
    deployment.set_api_key("sk-console-host-123")
    deployment.save()
    key = reverse("deployments:api_key", args=[deployment.pk])
    mode = reverse("deployments:rpc_mode", args=[deployment.pk])
    heal = reverse("deployments:self_heal", args=[deployment.pk])

    response = operator_client.get(key)
    assert "sk-console-host-123" not in response.content.decode()
    _refused(response, console_host)
    _refused(operator_client.post(mode, {"mode": "direct"}), console_host)
    _refused(operator_client.post(heal, {"on": "1"}), console_host)
    deployment.refresh_from_db()
    assert deployment.rpc_mode != "direct" and not deployment.self_heal
    assert not AuditEvent.objects.filter(action="deployment.api_key_viewed").exists()
    # The run page offers the operator none of the three, and an admin all of them.
    run = reverse("deployments:run", args=[deployment.pk])
    assert 'id="rpc-mode-form"' not in operator_client.get(run).content.decode()
    assert 'id="rpc-mode-form"' in admin_client.get(run).content.decode()
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.RUNNING)
    page = operator_client.get(run).content.decode()
    assert 'id="self-heal-button"' not in page and key not in page
    assert "Admins can show the API key: this deployment uses the console's own host." in page
    page = admin_client.get(run).content.decode()
    assert 'id="self-heal-button"' in page and key in page
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.CONFIRMED)

    assert "sk-console-host-123" in admin_client.get(key).content.decode()
    assert admin_client.post(mode, {"mode": "direct"}).status_code == 302
    deployment.refresh_from_db()
    assert deployment.rpc_mode == "direct"


def test_an_operator_keeps_the_api_key_rpc_mode_and_self_healing_on_remote_nodes(
    remote, operator_client, operator_user
):
    coordinator = NodeFactory(name="desk", may_coordinate=True)
    deployment = _deployment(coordinator, remote, created_by=operator_user)
    deployment.set_api_key("sk-remote-123")
    deployment.save()
    assert (
        "sk-remote-123"
        in operator_client.get(reverse("deployments:api_key", args=[deployment.pk])).content.decode()
    )
    assert (
        operator_client.post(
            reverse("deployments:rpc_mode", args=[deployment.pk]), {"mode": "direct"}
        ).status_code
        == 302
    )
    assert (
        operator_client.post(reverse("deployments:self_heal", args=[deployment.pk]), {"on": "1"}).status_code
        == 302
    )
    deployment.refresh_from_db()
    assert deployment.rpc_mode == "direct" and deployment.self_heal


# --------------------------------------------------------------------------------------------------
# Logs of jobs on the console's host: admins only (page, polling, download, live socket)


def _job_with_secret(node, created_by) -> Job:
    job = Job.objects.create(kind="command", node=node, title="cat var/encryption_key", created_by=created_by)
    job.append_lines([("out", "fernet-key-printed-by-the-command")])
    return job


def test_logs_of_jobs_on_the_console_host_are_for_admins_only(
    console_host, remote, client, viewer_user, operator_user, admin_user
):
    local_job = _job_with_secret(console_host, admin_user)
    remote_job = _job_with_secret(remote, operator_user)
    for user in (viewer_user, operator_user):
        client.force_login(user)
        for url in (
            reverse("jobs:detail", args=[local_job.pk]),
            reverse("jobs:detail", args=[local_job.pk]) + "?after=-1",  # the polling fallback
            reverse("jobs:log_download", args=[local_job.pk]),
        ):
            response = client.get(url, headers={"HX-Request": "true"} if "after" in url else {})
            assert response.status_code == 403, url
            assert "fernet-key-printed" not in response.content.decode()
            assert "the console&#x27;s own host" in response.content.decode()
        # Every other node's log stays readable to every role.
        assert client.get(reverse("jobs:detail", args=[remote_job.pk])).status_code == 200
        assert b"fernet-key-printed" in b"".join(
            client.get(reverse("jobs:log_download", args=[remote_job.pk])).streaming_content
        )
    event = AuditEvent.objects.filter(action="permission_denied").latest("pk")
    assert event.changes["local_node"] is True and event.object_id == str(local_job.pk)

    client.force_login(admin_user)
    assert b"fernet-key-printed" in client.get(reverse("jobs:detail", args=[local_job.pk])).content
    assert b"fernet-key-printed" in b"".join(
        client.get(reverse("jobs:log_download", args=[local_job.pk])).streaming_content
    )


def test_a_job_whose_node_was_deleted_counts_as_one_on_the_console_host(
    console_host, viewer_client, admin_user
):
    job = _job_with_secret(console_host, admin_user)
    console_host.delete()  # its jobs stay, without a node: where they ran can no longer be told
    job.refresh_from_db()
    assert job.node is None and job.node_name == "console-host"
    response = viewer_client.get(reverse("jobs:detail", args=[job.pk]))
    assert response.status_code == 403 and "a node since deleted" in response.content.decode()


@pytest.mark.django_db(transaction=True)
async def test_the_live_log_socket_of_a_console_host_job_is_for_admins_only(channel_layer):
    from channels.db import database_sync_to_async

    from tests.factories import UserFactory
    from tests.sockets import connect

    def world():
        console = NodeFactory(name="console-host", address="127.0.0.1", transport=Transport.LOCAL)
        remote_node = NodeFactory(name="old-pc", address="10.77.1.2")
        admin = UserFactory(username="alice", role="admin")
        users = {role: UserFactory(username=f"u-{role}", role=role) for role in ("viewer", "operator")}
        return _job_with_secret(console, admin), _job_with_secret(remote_node, None), admin, users

    local_job, remote_job, admin, users = await database_sync_to_async(world)()
    for user in users.values():
        communicator, connected, code = await connect(f"/ws/jobs/{local_job.pk}/", user)
        assert not connected and code == 4403
        await communicator.disconnect()
        communicator, connected, _ = await connect(f"/ws/jobs/{remote_job.pk}/", user)
        assert connected
        await communicator.disconnect()
    communicator, connected, _ = await connect(f"/ws/jobs/{local_job.pk}/?after=-1", admin)
    assert connected and "fernet-key-printed" in await communicator.receive_from(timeout=15)

    # An admin who stops being one stops watching at once.
    await database_sync_to_async(admin.groups.clear)()
    while (event := await communicator.receive_output(timeout=15))["type"] != "websocket.close":
        pass
    assert event["code"] == 4403
