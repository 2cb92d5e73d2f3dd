"""What a household sees is true and plain, in a real browser at a desktop's and a phone's width, as the admin
and as a family member with the chat role: an unknown address is the console's styled 404; a deployment
that stopped working says so in a sentence, with Restart for those who may restart it and neither Restart
nor chat for the others; a machine that is switched off is one line on the dashboard and on its page; the chat
role sees the chat and the endpoint and no button that changes the cluster; every Copy button puts its
snippet on the clipboard.

The deployments here are not started: their states are set through the model's own transition methods, and
the broken one is left degraded by the monitor's own code (monitor._apply) with what it sees of a
llama-server that is gone. tests/deployments/test_true_status_llamacpp.py does the same with a real
llama-server killed."""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
from django.urls import Resolver404, resolve, reverse
from django.utils import timezone
from playwright.sync_api import expect

from deployments import monitor
from deployments.models import Deployment, DeploymentState
from modelfiles.models import ModelFile
from nodes.models import Reachability, Transport
from ramdeck_site.roles import may_use
from tests.browser import CHROMIUM_FLAGS, REPORT_CSP_VIOLATIONS, chromium_path, csp_problems, log_in
from tests.console.test_error_pages import UNKNOWN_PATHS
from tests.factories import PASSWORD, DeviceFactory, NodeFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

WIDTHS = (1280, 390)
KEY = "family-key-0123456789abcdef"
GONE_PID = 4242


def _running(name: str, node, port: int) -> Deployment:
    """A deployment on `node`, taken to running through its own transitions, as a deploy run does."""
    model = ModelFile.objects.create(name=name, node=node, path=f"/models/{name}.gguf", size_bytes=2**28)
    deployment = Deployment.objects.create(
        name=f"{name} for the family", model_file=model, coordinator=node, plan={}, host="0.0.0.0", port=port
    )
    deployment.store_api_key(KEY)
    assert deployment.mark_preparing() and deployment.mark_launching() and deployment.mark_verifying()
    deployment.add_process(
        f"llama-server@{node.name}",
        {"node": node.name, "role": "llama-server", "pid": GONE_PID, "port": port,
         "log": f"/home/family/.ramdeck/logs/deployment-{deployment.pk}-llama-server.log"},
    )  # fmt: skip
    assert deployment.mark_running()
    return deployment


def _left_degraded_by_the_monitor(deployment: Deployment) -> str:
    """What the monitor stores when it finds llama-server's PID gone: its look, then degraded with why."""
    info = deployment.processes[f"llama-server@{deployment.coordinator.name}"]
    dead = {GONE_PID: f"llama-server on {deployment.coordinator.name} (PID {GONE_PID}) is not running. "
                      "Last log lines:\nsrv  operator(): cleaning up before exit..."}  # fmt: skip
    seen = monitor.Seen(dead=dead, rows=[{**info, "alive": False, "error": ""}])
    reason = monitor._apply(deployment, seen)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.DEGRADED and "is not running" in reason
    return reason


@pytest.fixture
def family(transactional_db):
    """The admin, an operator and a chat member; pc2 (answers, coordinates two deployments: one running,
    one whose llama-server is gone) and attic (switched off three hours ago)."""
    now = timezone.now()
    users = {
        "admin": UserFactory(username="alice-admin", role="admin"),
        "operator": UserFactory(username="oscar-operator", role="operator"),
        "chat": UserFactory(username="chloe-chat", role="chat"),
    }
    pc2 = NodeFactory(name="pc2", address="192.0.2.10", may_coordinate=True, last_seen_at=now,
                      reachability=Reachability.REACHABLE)  # fmt: skip
    DeviceFactory(node=pc2)
    attic = NodeFactory(name="attic", address="192.0.2.20", last_seen_at=now - timedelta(hours=3),
                        reachability=Reachability.REACHABLE)  # fmt: skip
    assert attic.mark_unreachable("192.0.2.20:22 did not answer within 10 s.", probed=True)
    working = _running("tinyllama", pc2, 8080)
    broken = _running("qwen", pc2, 8081)
    _left_degraded_by_the_monitor(broken)
    return {**users, "pc2": pc2, "attic": attic, "working": working, "broken": broken}


@contextmanager
def browsing(browser, base_url: str, user, width: int, *, clipboard: bool = False):
    """A logged-in page of its own (a fresh context: no cookie of another role) at `width`; fails the test
    when the page broke its Content-Security-Policy."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    if clipboard:
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base_url)
    context.set_default_timeout(15_000)
    context.add_init_script(REPORT_CSP_VIOLATIONS)
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    try:
        log_in(page, base_url, user.username, PASSWORD)
        yield page
    finally:
        context.close()
    assert not csp_problems(console), csp_problems(console)


def fits_the_window(page) -> None:
    wide = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert wide <= 0, f"{page.url} is {wide} px wider than the window"


def offered_routes(page, base_url: str) -> set[str]:
    """The named routes the page links to, posts to or loads into itself (same-origin addresses only)."""
    addresses = page.evaluate(
        """() => [
            ...[...document.querySelectorAll('a[href]')].map((a) => a.getAttribute('href')),
            ...[...document.querySelectorAll('form[action]')].map((f) => f.getAttribute('action')),
            ...[...document.querySelectorAll('[hx-get], [hx-post]')].map(
                (e) => e.getAttribute('hx-post') || e.getAttribute('hx-get')),
        ]"""
    )
    host = urlsplit(base_url).netloc
    routes = set()
    for address in addresses:
        parts = urlsplit(address)
        if not parts.path or (parts.netloc and parts.netloc != host):
            continue
        try:
            match = resolve(parts.path)
        except Resolver404:
            continue
        if match.view_name and not match.view_name.startswith("admin:"):
            routes.add(match.view_name)
    return routes


@pytest.mark.parametrize("width", WIDTHS)
def test_an_unknown_address_is_the_styled_404_in_the_browser_for_the_admin_and_the_chat_role(
    live_server_url, browser, family, width
):
    for role in ("admin", "chat"):
        with browsing(browser, live_server_url, family[role], width) as page:
            for path in UNKNOWN_PATHS:
                response = page.goto(f"{live_server_url}{path}")
                assert response.status == 404, (role, path, response.status)
                expect(page.locator("#error-404")).to_be_visible()
                expect(page.locator("#error-404")).to_contain_text(path)
                expect(page.locator("#topbar")).to_be_visible()
                fits_the_window(page)
            page.get_by_role("link", name="Back to the dashboard").click()
            page.wait_for_url(f"{live_server_url}/")
            expect(page.locator("h1")).to_have_text("Dashboard")


@pytest.mark.parametrize("width", WIDTHS)
def test_a_deployment_that_stopped_working_says_so_with_restart_for_operators_and_nothing_for_the_chat_role(
    live_server_url, browser, family, width
):
    broken = family["broken"]
    sentence = f"{broken.name} is not working: llama-server on pc2 stopped running (noticed at "
    run_url = f"{live_server_url}{reverse('deployments:run', args=[broken.pk])}"
    for role in ("admin", "operator", "chat"):
        restarts = role != "chat"
        with browsing(browser, live_server_url, family[role], width) as page:
            down = page.locator(f"#dash-down-{broken.pk}")
            expect(down).to_contain_text(sentence)
            expect(page.locator(f"#dash-deployment-{broken.pk}")).to_have_count(0)  # not "running"
            expect(page.locator(f"#dash-restart-{broken.pk}")).to_have_count(1 if restarts else 0)
            fits_the_window(page)

            page.goto(run_url)
            expect(page.locator("#deployment-state")).to_have_text("Degraded")
            expect(page.locator("#down-sentence")).to_contain_text(sentence)
            expect(page.locator("#restart-button")).to_have_count(1 if restarts else 0)
            expect(page.locator("#chat-with-it")).to_have_count(0)  # nobody answers
            if role == "chat":
                expect(page.locator("#chat-send")).to_be_disabled()
                expect(page.locator("#chat-unavailable")).to_be_visible()
                for button in ("#stop-button", "#redeploy-button", "#delete-button", "#self-heal-button"):
                    expect(page.locator(button)).to_have_count(0)
            else:
                expect(page.locator("#restart-button")).to_be_visible()
            fits_the_window(page)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_switched_off_machine_is_one_line_on_the_dashboard_and_on_its_page(
    live_server_url, browser, family, width
):
    attic = family["attic"]
    since = timezone.localtime(attic.unreachable_since)
    sentence = f"attic offline since {since:%H:%M}, last seen 3 hours ago"
    for role in ("admin", "chat"):
        with browsing(browser, live_server_url, family[role], width) as page:
            line = page.locator("#offline-attic")
            expect(line).to_contain_text(sentence)
            expect(line).to_contain_text("did not answer within 10 s.")
            expect(page.locator(".node-offline")).to_have_count(1)  # pc2 answers: no line of its own
            dashboard_text = " ".join(line.inner_text().split())
            line.get_by_role("link", name=sentence).click()
            page.wait_for_url(f"{live_server_url}{attic.get_absolute_url()}")
            banner = page.locator("#unreachable-banner")
            expect(banner).to_contain_text(sentence)
            assert " ".join(banner.inner_text().split()) == dashboard_text
            fits_the_window(page)


CHANGES_THE_CLUSTER = (
    "deployments:deploy",
    "deployments:stop",
    "deployments:restart",
    "deployments:redeploy",
    "deployments:delete",
    "deployments:confirm",
    "builds:start",
    "nodes:probe",
    "calibration:node",
    "run_command",
)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_chat_role_sees_the_chat_and_the_endpoint_and_no_button_that_changes_the_cluster(
    live_server_url, browser, family, width
):
    working, broken, pc2 = family["working"], family["broken"], family["pc2"]
    chat_user = family["chat"]
    pages = [
        reverse("dashboard"),
        reverse("nodes:list"),
        reverse("nodes:detail", args=[pc2.name]),
        reverse("nodes:detail", args=[family["attic"].name]),
        reverse("builds:node", args=[pc2.name]),
        reverse("modelfiles:list"),
        reverse("deployments:list"),
        reverse("deployments:detail", args=[working.pk]),
        reverse("deployments:run", args=[working.pk]),
        reverse("deployments:run", args=[broken.pk]),
        reverse("chat:page", args=[working.pk]),
        reverse("deployments:api_key", args=[working.pk]),
        reverse("help"),
    ]
    with browsing(browser, live_server_url, chat_user, width) as page:
        for path in pages:
            response = page.goto(f"{live_server_url}{path}")
            assert response.status == 200, (path, response.status)
            offered = offered_routes(page, live_server_url)
            refused = sorted(route for route in offered if not may_use(chat_user, route))
            assert not refused, f"{path} offers the chat role {refused}"
            assert not offered & set(CHANGES_THE_CLUSTER), (path, offered & set(CHANGES_THE_CLUSTER))
            fits_the_window(page)

        page.goto(f"{live_server_url}{reverse('deployments:run', args=[working.pk])}")
        expect(page.locator("#deployment-state")).to_have_text("Running")
        expect(page.locator("#endpoint-url")).to_have_text("http://192.0.2.10:8080")
        expect(page.locator("#chat-with-it")).to_be_visible()
        expect(page.locator("#chat-send")).to_be_enabled()
        expect(page.locator("#chat-viewer-note")).to_have_count(0)
        page.get_by_role("link", name="Show API key and example").click()
        expect(page.locator("#api-key")).to_have_value(KEY)

    # The admin, on the same run page, has the buttons the chat role does not.
    with browsing(browser, live_server_url, family["admin"], width) as page:
        page.goto(f"{live_server_url}{reverse('deployments:run', args=[working.pk])}")
        expect(page.locator("#stop-button")).to_be_visible()
        expect(page.locator("#restart-button")).to_be_visible()
        expect(page.locator("#chat-with-it")).to_be_visible()


def _copies(page) -> dict[str, str]:
    """Press every Copy button on the page; {the copied element's selector: what the clipboard then held}."""
    copied = {}
    buttons = page.locator("[data-copy]:visible")
    assert buttons.count() > 0
    for index in range(buttons.count()):
        button = buttons.nth(index)
        target = button.get_attribute("data-copy")
        page.evaluate("navigator.clipboard.writeText('')")
        button.click()
        expect(button).to_have_text("Copied")
        copied[target] = page.evaluate("navigator.clipboard.readText()")
    return copied


def _shown(page, selector: str) -> str:
    return page.locator(selector).evaluate("(el) => el.value ?? el.textContent")


@pytest.mark.parametrize("width", WIDTHS)
def test_every_copy_button_puts_its_snippet_on_the_clipboard(live_server_url, browser, family, width):
    working = family["working"]
    snippets = ["#api-key", "#curl-example", "#python-example", "#openwebui-env", "#openwebui-run"]
    for role in ("admin", "chat"):
        with browsing(browser, live_server_url, family[role], width, clipboard=True) as page:
            # The run page: the endpoint, then the key and the examples it loads in place.
            page.goto(f"{live_server_url}{reverse('deployments:run', args=[working.pk])}")
            page.get_by_role("link", name="Show API key and example").click()
            expect(page.locator("#api-key")).to_have_value(KEY)
            copied = _copies(page)
            assert sorted(copied) == sorted(["#endpoint-url", *snippets]), copied
            for selector, text in copied.items():
                assert text and text == _shown(page, selector), (role, selector, text)
            assert copied["#endpoint-url"] == "http://192.0.2.10:8080"
            assert copied["#api-key"] == KEY and f"OPENAI_API_KEY={KEY}" in copied["#openwebui-env"]
            assert "http://192.0.2.10:8080/v1" in copied["#curl-example"]

            # The key's own page: the same snippets, each copied whole.
            page.goto(f"{live_server_url}{reverse('deployments:api_key', args=[working.pk])}")
            copied = _copies(page)
            assert sorted(copied) == sorted(snippets), copied
            for selector, text in copied.items():
                assert text and text == _shown(page, selector), (role, selector, text)


@pytest.mark.parametrize("width", WIDTHS)
def test_on_the_consoles_own_host_an_operator_is_told_an_admin_restarts_it_instead_of_a_button_that_refuses(
    live_server_url, browser, family, width
):
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=timezone.now(), reachability=Reachability.REACHABLE)  # fmt: skip
    broken = _running("phi", desk, 8082)
    _left_degraded_by_the_monitor(broken)
    run_url = f"{live_server_url}{reverse('deployments:run', args=[broken.pk])}"
    for role in ("admin", "operator"):
        admin = role == "admin"
        with browsing(browser, live_server_url, family[role], width) as page:
            expect(page.locator(f"#dash-down-{broken.pk}")).to_contain_text("is not working")
            expect(page.locator(f"#dash-restart-{broken.pk}")).to_have_count(1 if admin else 0)
            page.goto(run_url)
            expect(page.locator("#down-sentence")).to_contain_text(f"{broken.name} is not working")
            for button in ("#restart-button", "#stop-button"):
                expect(page.locator(button)).to_have_count(1 if admin else 0)
            note = page.locator("#admins-only")
            if admin:
                expect(note).to_have_count(0)
            else:
                expect(note).to_contain_text("desk is the console's own host")
                # The Stop question, reached by its address, says the same rather than offer a refusal.
                page.goto(f"{live_server_url}{reverse('deployments:stop', args=[broken.pk])}")
                expect(page.locator("#admins-only")).to_contain_text("Ask an admin to stop it.")
                expect(page.locator("#confirm-stop")).to_have_count(0)
            fits_the_window(page)


LAN_NAME = "ramdeck.home.arpa"  # how the household reaches the console with RAMDECK_BIND=0.0.0.0


@pytest.fixture
def lan_browser(browser):
    """A Chromium that finds LAN_NAME at 127.0.0.1: a page from http://ramdeck.home.arpa:PORT is no secure
    context (only loopback and https are), as the console is over plain http from another machine."""
    instance = browser.browser_type.launch(
        executable_path=chromium_path(),
        headless=True,
        args=[*CHROMIUM_FLAGS, f"--host-resolver-rules=MAP {LAN_NAME} 127.0.0.1"],
    )
    yield instance
    instance.close()


@pytest.fixture
def lan_hosts(settings):
    """Set before the live server forks, so it answers to LAN_NAME."""
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, LAN_NAME]


@pytest.mark.parametrize("width", WIDTHS)
def test_copy_buttons_work_over_plain_http_from_another_machine(
    lan_hosts, live_server_url, lan_browser, family, width
):
    working = family["working"]
    lan_url = live_server_url.replace("127.0.0.1", LAN_NAME)
    context = lan_browser.new_context(viewport={"width": width, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=live_server_url)
    context.set_default_timeout(15_000)
    context.add_init_script(REPORT_CSP_VIOLATIONS)
    console: list[str] = []
    try:
        page = context.new_page()
        page.on("console", lambda message: console.append(message.text))
        log_in(page, lan_url, family["chat"].username, PASSWORD)
        page.goto(f"{lan_url}{reverse('deployments:api_key', args=[working.pk])}")
        assert not page.evaluate("window.isSecureContext") and page.evaluate("!navigator.clipboard")
        # The clipboard is read from a page that may read it: one on loopback, in the same browser.
        reader = context.new_page()
        reader.goto(f"{live_server_url}/login/")
        buttons = page.locator("[data-copy]:visible")
        assert buttons.count() == 5
        for index in range(buttons.count()):
            button = buttons.nth(index)
            selector = button.get_attribute("data-copy")
            reader.evaluate("navigator.clipboard.writeText('')")
            page.bring_to_front()
            button.click()
            expect(button).to_have_text("Copied")
            reader.bring_to_front()
            text = reader.evaluate("navigator.clipboard.readText()")
            assert text and text == _shown(page, selector), (selector, text)
    finally:
        context.close()
    assert not csp_problems(console), csp_problems(console)
