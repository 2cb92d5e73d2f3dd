"""A new admin follows the dashboard's first-run checklist on the console's own machine, in a real browser:
"Add this machine" → the probe (a real Celery worker, the local transport) finds the real llama.cpp build →
it is recorded as a build → the small real model (SmolLM2-135M-Instruct, from the package index) is
registered with one button → a plan is confirmed → deployed (the worker starts the real llama-server) → an
answer in English in the chat box (greedy sampling); the checklist ticks at each step and is gone at the end.

On the way it saves the README's screenshots (tests/browser.py `save_screenshots`): into the test's tmp_path,
or into RAMDECK_SCREENSHOTS_DIR when set (`make screenshots` sets docs/screenshots)."""

from __future__ import annotations

import os
import re

import pytest
from playwright.sync_api import expect

from builds.models import Build
from deployments.models import Deployment, DeploymentState
from jobs.models import Job, JobState
from llamacpp import real_model
from modelfiles.models import ModelFile
from nodes.models import Node, Transport
from tests.browser import checklist_ticks, in_own_thread, log_in, save_screenshots, screenshot_dir
from tests.chat_fixtures import free_port, stop, wait_until_port_free
from tests.factories import PASSWORD, UserFactory
from tests.job_fixtures import CeleryWorker, wait_for
from tests.llamacpp_build import require_llamacpp
from tests.real_model import require_real_model

pytestmark = [pytest.mark.browser, pytest.mark.llamacpp, pytest.mark.e2e, pytest.mark.timeout(900)]
CHAT_MAX_TOKENS = 48
# Words nearly every English sentence of a few dozen words holds; a broken split or random weights write none.
COMMON_WORDS = {"the", "is", "of", "a", "and", "to", "in", "it", "with", "that", "story", "fox"}


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
def short_answers(settings):
    """Set before the live server forks, so the chat answers greedily with at most CHAT_MAX_TOKENS tokens."""
    settings.RAMDECK_CHAT_MAX_TOKENS = CHAT_MAX_TOKENS
    settings.RAMDECK_CHAT_TEMPERATURE = 0.0


@pytest.fixture
def live_url(celery_worker, short_answers, live_server_url):
    """The live server, forked after the worker's queue became the console's."""
    return live_server_url


def test_a_new_admin_follows_the_checklist_on_this_machine(
    live_url, page, llamacpp_on_path, tmp_path, monkeypatch
):
    require_real_model()  # in the per-user cache: the button below finds it there
    shots = screenshot_dir(tmp_path)
    admin = UserFactory(username="nina-new", role="admin")
    log_in(page, live_url, "nina-new", PASSWORD)
    expect(page.locator("#first-run")).to_contain_text("0 of 10 done")
    assert checklist_ticks(page) == set()

    # This machine's node calibrates on its RPC port (50052): an rpc-server an earlier test started there may
    # still be ending (its stop runs in a worker), and a port held then fails the calibration, not this walk.
    wait_until_port_free(50052)

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
    # The recorded build queued this machine's first calibration by itself: the plan rests on measurements.
    queued = Job.objects.filter(node=node, kind="calibrate")
    wait_for(queued.exists, timeout=60, what="the calibration the build queues")
    calibration = queued.get()
    ended = lambda: Job.objects.get(pk=calibration.pk).is_terminal  # noqa: E731
    wait_for(ended, timeout=300, what="the first calibration")
    calibration.refresh_from_db()
    assert calibration.state == JobState.SUCCEEDED, calibration.result
    page.goto(f"{live_url}/")
    expect(page.locator("#first-run")).to_contain_text("6 of 10 done")
    assert checklist_ticks(page) == {"credential", "node", "host_key", "probe", "build", "calibrated"}
    save_screenshots(page, shots, "first-run")

    # The builds page shows it in use and no longer offers the detected install.
    page.goto(f"{live_url}/builds/{node.name}/")
    expect(page.locator("#builds")).to_contain_text(llamacpp_on_path)
    expect(page.locator("#use-detected-install")).to_have_count(0)

    # 3. A model: the checklist's button brings the small real model onto this machine, a job with a log.
    page.goto(f"{live_url}/")
    page.click("#first-run-model-try")
    job = Job.objects.get(kind="real_model")
    assert job.node == node
    expect(page.locator("body")).to_contain_text("Registered SmolLM2 135M Instruct", timeout=120_000)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.result
    model = ModelFile.objects.get()
    assert model.name == real_model.MODEL_NAME and model.sha256 == real_model.GGUF_SHA256

    # 4. The plan, from the checklist's link, confirmed.
    page.goto(f"{live_url}/")
    assert "model" in checklist_ticks(page)
    page.click("#first-run-plan-action")
    page.fill("input[name=name]", "SmolLM2 on this machine")
    # Loopback (this machine only, the console's chat included) on a port nobody else's test holds.
    page.fill("#endpoint-port", str(free_port()))
    expect(page.locator("#confirm-plan")).to_be_enabled()
    # This machine is calibrated: its speed figures are measured, not the table's guesses.
    expect(page.locator("#speed-guess")).to_have_count(0)
    save_screenshots(page, shots, "plan")
    page.click("#confirm-plan")
    expect(page.locator("#deployment-state")).to_have_text("Confirmed")
    assert Deployment.objects.count() == 1

    page.goto(f"{live_url}/")
    expect(page.locator("#first-run")).to_contain_text("8 of 10 done")
    expect(page.locator("#first-run-deploy-action")).to_have_attribute(
        "href", f"/deployments/{Deployment.objects.get().pk}/run/"
    )

    # The audit history tells the story in sentences.
    page.goto(f"{live_url}/audit/")
    # (The changes are listed in key order, whichever database stores them.)
    expect(page.locator("#audit-table")).to_contain_text(f"nina-new added node {node.name}: ")
    expect(page.locator("#audit-table")).to_contain_text("transport: local")
    expect(page.locator("#audit-table")).to_contain_text(
        f"nina-new asked for a llama.cpp build on node {node.name}"
    )
    expect(page.locator("#audit-table")).to_contain_text("nina-new registered model SmolLM2 135M Instruct: ")
    expect(page.locator("#audit-table")).to_contain_text(
        "nina-new confirmed the plan of deployment SmolLM2 on this"
    )
    expect(page.locator("#audit-table")).to_contain_text(re.compile(r"predicted tokens per s: \d"))

    # 5. Deploy, from the checklist's link: the worker starts the real llama-server on this machine.
    deployment = Deployment.objects.get()
    try:
        page.goto(f"{live_url}/")
        page.click("#first-run-deploy-action")
        page.click("#deploy-button")
        try:
            expect(page.locator("#deployment-state")).to_have_text("Running", timeout=180_000)
        except AssertionError:
            deployment.refresh_from_db()
            steps = [(s.name, s.job.state, s.job.result) for s in deployment.steps.select_related("job")]
            raise AssertionError(f"{deployment.state}: {deployment.state_reason}; steps: {steps}") from None
        expect(page.locator("#speed")).to_contain_text("Measured")

        # 6. Talk to it: the real model's answer streams in through the console, in English.
        expect(page.locator("#chat-send")).to_be_enabled()
        page.fill("#chat-input", "Tell me a story about a fox.")
        page.press("#chat-input", "Enter")
        answer = page.locator(".chat-message.assistant")
        expect(answer.locator(".chat-meta")).to_contain_text("tokens", timeout=120_000)
        expect(answer).not_to_have_class("streaming")
        text = answer.locator(".chat-text").inner_text().strip()
        words = set(re.findall(r"[a-z]+", text.lower()))
        assert len(words & COMMON_WORDS) >= 3, text
        expect(page.locator("#chat-error")).to_be_hidden()
        deployment.refresh_from_db()
        assert deployment.api_key() and deployment.api_key() not in page.content()
        save_screenshots(page, shots, "deployment")
        page.locator("#chat").scroll_into_view_if_needed()
        save_screenshots(page, shots, "chat", selector="#chat")

        # Every step is done (the chat box's answer ticked the last one): the checklist makes way for
        # the dashboard's gauges and the running deployment.
        page.goto(f"{live_url}/")
        expect(page.locator("#first-run")).to_have_count(0)
        expect(page.locator(f"#dash-deployment-{deployment.pk}")).to_contain_text("SmolLM2 on this machine")
        save_screenshots(page, shots, "dashboard")

        # 7. Stop (it asks first); nothing is left running.
        page.goto(f"{live_url}/deployments/{deployment.pk}/run/")
        page.click("#stop-button")
        page.click("#confirm-stop")
        expect(page.locator("#deployment-state")).to_have_text("Stopped", timeout=120_000)
    finally:
        deployment.refresh_from_db()
        if deployment.state not in (
            DeploymentState.STOPPED,
            DeploymentState.FAILED,
            DeploymentState.CONFIRMED,
        ):
            in_own_thread(stop, deployment, admin, monkeypatch)
