"""A new admin follows the dashboard's first-run checklist to another machine of the household, in a real
browser, against a lab host (a network namespace with a real sshd, see tests/lab):

the console generates an SSH key pair → the admin puts its public key on the node (what the page's
`authorized_keys` line does there) → adds the node → the first probe meets the node's unknown host key and
stops at "needs approval" with the Approve button → approved, the probe runs (a real Celery worker, over SSH)
→ llama.cpp is built there from the pinned source (the build finds it compiled, as a node that built it
before would) → a model on that node is registered by its path → a plan is confirmed → deployed (the real
llama-server on the lab host) → the chat box gets an answer through the console. Every checklist step ticks
itself from the database on the way, and the list is gone at the end.

It saves screenshots of the key and the host-key approval (tests/browser.py `save_screenshots`) into the
test's tmp_path, or into RAMDECK_SCREENSHOTS_DIR when set."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from builds.models import Build
from deployments.models import Deployment, DeploymentState
from jobs.models import Job, JobState
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from nodes.models import Credential, Node
from tests.browser import checklist_ticks, in_own_thread, log_in, save_screenshots, screenshot_dir
from tests.chat_fixtures import TALKATIVE_SEED, stop
from tests.factories import PASSWORD, UserFactory
from tests.job_fixtures import CeleryWorker, wait_for
from tests.llamacpp_build import BUILD_ROOT, TARBALL_DIR, require_llamacpp, use_cached_llamacpp

pytestmark = [pytest.mark.browser, pytest.mark.lab, pytest.mark.e2e, pytest.mark.timeout(900)]
CHAT_MAX_TOKENS = 48


@pytest.fixture
def lab_node_host(lab, lab_host, settings, monkeypatch):
    """One lab host whose sshd lets nobody in yet, and the compiled llama.cpp its build will find."""
    require_llamacpp()
    use_cached_llamacpp(settings)
    # The worker (started afterwards) reads these from its environment.
    monkeypatch.setenv("RAMDECK_TARBALL_DIR", str(TARBALL_DIR))
    monkeypatch.setenv("RAMDECK_BUILD_ROOT", str(BUILD_ROOT))
    authorized = lab_host.workdir / "authorized_keys"
    authorized.write_text("")  # the lab's own test key is not what this admin uses
    return lab_host


@pytest.fixture
def celery_worker(lab_node_host, transactional_db, tmp_path):
    worker = CeleryWorker(tmp_path, default_queue=True).start()
    yield worker
    worker.stop()


@pytest.fixture
def short_answers(settings):
    """Set before the live server forks (a setting changed after the fork never reaches it), so the chat
    answers with at most CHAT_MAX_TOKENS tokens."""
    settings.RAMDECK_CHAT_MAX_TOKENS = CHAT_MAX_TOKENS


@pytest.fixture
def live_url(celery_worker, short_answers, live_server_url):
    """The live server, forked after the worker's queue became the console's and with short chat answers."""
    return live_server_url


def dashboard(page, live_url: str, done: int) -> set[str]:
    page.goto(f"{live_url}/")
    expect(page.locator("#first-run")).to_contain_text(f"{done} of 10 done")
    return checklist_ticks(page)


def test_a_new_admin_follows_the_checklist_to_a_lab_host_over_ssh(
    live_url, lab_node_host, page, tmp_path, monkeypatch
):
    host = lab_node_host
    shots = screenshot_dir(tmp_path)
    admin = UserFactory(username="sam-first", role="admin")
    log_in(page, live_url, "sam-first", PASSWORD)
    assert dashboard(page, live_url, 0) == set()

    # 1. A credential: the console generates the key pair and shows the line to run on the node.
    page.click("#first-run-credential-ssh")
    page.fill("#credential-form input[name=name]", "household key")
    page.check("#credential-form input[name=generate]")
    page.click("#credential-form button[type=submit]")
    expect(page.locator(".message.success")).to_contain_text("Key pair generated for household key")
    public_key = page.locator("#public-key-line").inner_text().strip()
    assert public_key.startswith("ssh-ed25519 ") and public_key == Credential.objects.get().public_key
    expect(page.locator("#authorized-keys-command")).to_contain_text(public_key)
    save_screenshots(page, shots, "first-run-ssh-key", selector="#public-key")
    # On the node, the admin runs that line: the key lands in the file this lab host's sshd reads.
    (host.workdir / "authorized_keys").write_text(public_key + "\n")
    assert dashboard(page, live_url, 1) == {"credential"}

    # 2. The node, from the checklist's link.
    page.click("#first-run-node-action")
    page.fill("#node-form input[name=name]", "study-pc")
    page.fill("#node-form input[name=address]", host.address)
    page.fill("#node-form input[name=ssh_user]", "root")
    page.select_option("#node-form select[name=credential]", label="household key")
    page.check("#node-form input[name=may_coordinate]")
    page.click("#node-form button[type=submit]")
    expect(page.locator(".message.success")).to_contain_text("Node study-pc added; probing its hardware now.")
    node = Node.objects.get()

    # 3. The probe queued on add meets the host key: "needs approval", with the Approve button where it says.
    probe = Job.objects.get(node=node, kind="probe")
    wait_for(lambda: Job.objects.get(pk=probe.pk).is_terminal, timeout=60, what="the first probe's end")
    assert dashboard(page, live_url, 2) == {"credential", "node"}
    page.goto(f"{live_url}{node.get_absolute_url()}")
    expect(page.locator("#host-key-banner")).to_contain_text("New host key")
    probe.refresh_from_db()
    assert probe.state == JobState.NEEDS_APPROVAL, probe.result
    node.refresh_from_db()
    assert node.pending_host_key == host.host_public_key and not node.host_key
    # The checklist sends the admin to that node's key.
    page.goto(f"{live_url}/")
    expect(page.locator("#first-run-host_key-action")).to_have_attribute("href", node.get_absolute_url())
    page.click("#first-run-host_key-action")
    save_screenshots(page, shots, "first-run-host-key", selector="#host-key-banner")
    page.click("#host-key-banner button[type=submit]")
    expect(page.locator(".message.success")).to_contain_text("approved for study-pc")
    # Approving probes again, now over the trusted connection.
    wait_for(
        lambda: Node.objects.filter(pk=node.pk, last_seen_at__isnull=False).exists(), timeout=120,
        what="the probe after approval",
    )  # fmt: skip
    node.refresh_from_db()
    assert node.host_key == host.host_public_key and node.devices.filter(name="CPU").exists()
    assert dashboard(page, live_url, 4) == {"credential", "node", "host_key", "probe"}

    # 4. llama.cpp on the node, built from the pinned source the console uploads (the builds page's default).
    page.click("#first-run-build-action")
    page.click("#start-build")
    wait_for(lambda: Job.objects.filter(node=node, kind="build").exists(), timeout=30, what="the build job")
    build_job = Job.objects.get(node=node, kind="build")
    wait_for(lambda: Job.objects.get(pk=build_job.pk).is_terminal, timeout=300, what="the build on study-pc")
    build_job.refresh_from_db()
    assert build_job.state == JobState.SUCCEEDED, build_job.result
    build = Build.objects.get(node=node)
    assert build.rpc_protocol and build.llama_server_path.endswith("/llama-server")
    assert "build" in dashboard(page, live_url, 5)
    # The recorded build queued the node's first calibration by itself; it ticks the next step.
    queued = Job.objects.filter(node=node, kind="calibrate")
    wait_for(queued.exists, timeout=60, what="the calibration the build queues")
    calibration = queued.get()
    ended = lambda: Job.objects.get(pk=calibration.pk).is_terminal  # noqa: E731
    wait_for(ended, timeout=300, what="the first calibration")
    calibration.refresh_from_db()
    assert calibration.state == JobState.SUCCEEDED, calibration.result
    assert "calibrated" in dashboard(page, live_url, 6)

    # 5. A model on the node, registered by its path there (the console reads its header over SFTP).
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama(n_layer=4, n_embd=128, seed=TALKATIVE_SEED))
    page.click("#first-run-model-action")
    page.fill("#register-model input[name=name]", "tiny")
    page.select_option("#register-model select[name=node]", label=node.name)
    page.fill("#register-model input[name=path]", str(path))
    page.click("#register-model button[type=submit]")
    expect(page.locator(".message.success")).to_contain_text("Registered tiny.")
    assert "model" in dashboard(page, live_url, 7)

    # 6. The plan, confirmed: the coordinator is not the console's, so the endpoint is on its LAN address.
    page.click("#first-run-plan-action")
    page.fill("input[name=name]", "tiny on the study pc")
    expect(page.locator("#confirm-plan")).to_be_enabled()
    page.click("#confirm-plan")
    expect(page.locator("#deployment-state")).to_have_text("Confirmed")
    deployment = Deployment.objects.get()
    assert "plan" in dashboard(page, live_url, 8)

    try:
        # 7. Deploy: the worker starts the real llama-server on the lab host.
        page.click("#first-run-deploy-action")
        page.click("#deploy-button")
        try:
            expect(page.locator("#deployment-state")).to_have_text("Running", timeout=180_000)
        except AssertionError:
            deployment.refresh_from_db()
            steps = [(s.name, s.job.state, s.job.result) for s in deployment.steps.select_related("job")]
            raise AssertionError(f"{deployment.state}: {deployment.state_reason}; steps: {steps}") from None
        expect(page.locator("#endpoint-url")).to_contain_text(f"http://{host.address}:")
        # Running and measured, but nobody has talked to it yet: the last step is still to do.
        assert "chat" not in dashboard(page, live_url, 9)

        # 8. Talk to it, from the checklist's link: the answer streams from the lab host through the console.
        page.click("#first-run-chat-action")
        expect(page.locator("#chat-send")).to_be_enabled()
        page.fill("#chat-input", "Tell me a story about a fox.")
        page.press("#chat-input", "Enter")
        answer = page.locator(".chat-message.assistant")
        expect(answer.locator(".chat-meta")).to_contain_text("tokens", timeout=120_000)
        assert answer.locator(".chat-text").inner_text().strip()
        expect(page.locator("#chat-error")).to_be_hidden()
        deployment.refresh_from_db()
        assert deployment.chat_answered_at is not None
        assert deployment.api_key() not in page.content()

        # Every step done: the checklist makes way for the dashboard.
        page.goto(f"{live_url}/")
        expect(page.locator(f"#dash-deployment-{deployment.pk}")).to_contain_text("tiny on the study pc")
        expect(page.locator("#first-run")).to_have_count(0)

        # 9. Stop (it asks first).
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
