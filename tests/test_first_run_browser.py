"""A new admin follows the dashboard's first-run checklist on the console's own machine, in a real browser:
"Add this machine" → the probe (a real Celery worker, the local transport) finds the real llama.cpp build →
it is recorded as a build → a model is registered → a plan is confirmed; the checklist ticks at each step.
The deploy and chat steps need a running model (tests/test_deploy_browser.py deploys one)."""

from __future__ import annotations

import os
import re

import pytest
from playwright.sync_api import expect

from deployments.models import Deployment
from deployments.tiny_model import TinyLlama, write_tiny_llama
from jobs.models import Job, JobState
from nodes.models import Build, Node, Transport
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory
from tests.job_fixtures import CeleryWorker, wait_for
from tests.llamacpp_build import require_llamacpp

pytestmark = [pytest.mark.browser, pytest.mark.llamacpp, pytest.mark.timeout(600)]


@pytest.fixture
def llamacpp_on_path(monkeypatch):
    """The machine's llama.cpp install, on the PATH where the probe looks first (as `make install` would put
    it): the worker started afterwards inherits it."""
    binaries = require_llamacpp()
    folder = str(binaries.llama_server.parent)
    assert binaries.rpc_server.parent == binaries.llama_server.parent
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder


@pytest.fixture
def model_dir(tmp_path, settings, monkeypatch):
    """The console's model folder (only files in it may be registered on its own host), for the live
    server forked later and for the worker."""
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path)]
    monkeypatch.setenv("RAMDECK_MODEL_DIRS", str(tmp_path))
    return tmp_path


@pytest.fixture
def celery_worker(llamacpp_on_path, model_dir, transactional_db, tmp_path):
    worker = CeleryWorker(tmp_path, default_queue=True).start()
    yield worker
    worker.stop()


@pytest.fixture
def live_url(celery_worker, live_server_url):
    """The live server, forked after the worker's queue became the console's."""
    return live_server_url


def ticked(page) -> set[str]:
    items = page.locator("#first-run li.done")
    return {items.nth(i).get_attribute("id").removeprefix("first-run-") for i in range(items.count())}


def test_a_new_admin_follows_the_checklist_on_this_machine(live_url, page, llamacpp_on_path, tmp_path):
    UserFactory(username="nina-new", role="admin")
    log_in(page, live_url, "nina-new", PASSWORD)
    expect(page.locator("#first-run")).to_contain_text("0 of 9 done")
    assert ticked(page) == set()

    # 1. Add this machine: a Local node that may coordinate, probed at once.
    page.click("#first-run-credential-action")
    expect(page.locator(".message.success")).to_contain_text("This machine is node")
    node = Node.objects.get()
    assert node.transport == Transport.LOCAL and node.may_coordinate

    # 2. The probe finds the llama.cpp on the PATH, and its install becomes a build (nothing compiled).
    wait_for(lambda: Build.objects.filter(node=node).exists(), timeout=180, what="the detected build")
    probe = Job.objects.get(node=node, kind="probe")
    assert probe.state == JobState.SUCCEEDED, probe.result
    build = Build.objects.get(node=node)
    assert build.source_kind == "existing" and build.llama_server_path == f"{llamacpp_on_path}/llama-server"
    assert build.rpc_protocol and build.version
    page.goto(f"{live_url}/")
    expect(page.locator("#first-run")).to_contain_text("5 of 9 done")
    assert ticked(page) == {"credential", "node", "host_key", "probe", "build"}

    # The builds page shows it in use and no longer offers the detected install.
    page.goto(f"{live_url}/builds/{node.name}/")
    expect(page.locator("#builds")).to_contain_text(llamacpp_on_path)
    expect(page.locator("#use-detected-install")).to_have_count(0)

    # 3. A model, from the checklist's link.
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama(n_layer=4, n_embd=128))
    page.goto(f"{live_url}/")
    page.click("#first-run-model-action")
    page.fill("#register-model input[name=name]", "tiny")
    page.select_option("#register-model select[name=node]", label=node.name)
    page.fill("#register-model input[name=path]", str(path))
    page.click("#register-model button[type=submit]")
    expect(page.locator(".message.success")).to_contain_text("Registered tiny.")

    # 4. The plan, from the checklist's link, confirmed.
    page.goto(f"{live_url}/")
    assert "model" in ticked(page)
    page.click("#first-run-plan-action")
    page.fill("input[name=name]", "tiny on this machine")
    page.click("#confirm-plan")
    expect(page.locator("#deployment-state")).to_have_text("Confirmed")
    assert Deployment.objects.count() == 1

    page.goto(f"{live_url}/")
    expect(page.locator("#first-run")).to_contain_text("7 of 9 done")
    expect(page.locator("#first-run-deploy-action")).to_have_attribute(
        "href", f"/deployments/{Deployment.objects.get().pk}/run/"
    )

    # The audit history tells the story in sentences.
    page.goto(f"{live_url}/audit/")
    expect(page.locator("#audit-table")).to_contain_text(f"nina-new added node {node.name}: transport: local")
    expect(page.locator("#audit-table")).to_contain_text(
        f"nina-new asked for a llama.cpp build on node {node.name}"
    )
    expect(page.locator("#audit-table")).to_contain_text("nina-new registered model tiny: node: ")
    expect(page.locator("#audit-table")).to_contain_text(
        "nina-new confirmed the plan of deployment tiny on this"
    )
    expect(page.locator("#audit-table")).to_contain_text(re.compile(r"predicted tokens per s: \d"))
