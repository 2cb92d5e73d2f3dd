"""Every page of the console on a phone (390 px) and a desktop (1280 px), in a real browser, with realistic
data: nothing makes the document wider than the window. The page list comes from the URL configuration, so
a new page is visited (or must be listed below with the reason it is not) before this test passes again.
Also: the styled 403 and 404 pages, and the navigation menu that folds on a phone."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from playwright.sync_api import expect

from deployments.models import StaleProcess
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory
from tests.household import household_pages
from tests.paths import ROOT

pytestmark = pytest.mark.browser
MIB = 2**20
ARTIFACTS = ROOT / "test-artifacts" / "phones"

# Routes that are not pages one can look at, and why. Each POST-only one is checked to refuse a GET.
POST_ONLY = {
    "logout": "logs out",
    "nodes:probe": "starts a probe job",
    "nodes:add_this_machine": "adds the console's host as a node (a button on the dashboard, node list)",
    "nodes:approve_host_key": "approves a host key",
    "users:unlock": "unlocks a locked-out account (the button is on the users page)",
    "nodes:credential_delete": "deletes at once (the list asks first)",
    "jobs:cancel": "cancels a job",
    "modelfiles:register": "registers a model (the form is on the models page)",
    "modelfiles:download": "starts a download (the form is on the models page)",
    "deployments:confirm": "confirms a plan (the button is on the plan page)",
    "deployments:manual": "checks a split by hand (the form is on the plan page)",
    "deployments:deploy": "starts a deployment",
    "deployments:restart": "restarts a deployment",
    "deployments:redeploy": "redeploys a plan",
    "builds:start": "starts a build (the form is on the builds page)",
    "deployments:stale_reap": "reaps a stale process",
    "calibration:node": "starts a calibration job (the button is on the node page)",
    "calibration:all": "starts calibration jobs (the button is on the node list)",
    "deployments:self_heal": "turns self-healing on or off (the switch is on the run page)",
    "chat:deployment": "streams a chat answer (the chat box is on the run page)",
    "deployments:rpc_mode": "chooses tunnel or direct RPC (the form is on the run page)",
    "modelfiles:try_real": "registers the small real model (the button is on the models page)",
    "nodes:rpc_cache_read": "reads a node's RPC cache size (the button is on the node page)",
    "modelfiles:copy": "copies a model to a node (the form is on the node page)",
    "deployments:recalibrate": "stops, calibrates a node and starts again (the button is on the node page)",
}
NOT_PAGES = {
    "dashboard_live": "the dashboard's live regions as htmx fragments (its polling fallback)",
    "deployments:processes": "an htmx fragment of the run page (measured there, where it is loaded)",
    "jobs:log_download": "a text/plain download of the log, not a page",
    "admin:*": "Django's stock admin (users are managed on the console's own Users page)",
}


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


SHOTS = {"dashboard", "deployments:run", "deployments:plan", "builds:node", "jobs:detail", "404"}


@pytest.mark.parametrize("width", [390, 1280])
def test_every_page_fits_the_window_without_sideways_scroll(live_server_url, browser, household, width):
    pages = household_pages(household)
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
    page.goto(base_url + reverse("builds:node", args=[data["desk"].name]))
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
        "deployments:manual": [data["model"].pk],
        "deployments:deploy": [data["deployment"].pk],
        "deployments:restart": [data["deployment"].pk],
        "deployments:redeploy": [data["deployment"].pk],
        "builds:start": [data["desk"].name],
        "deployments:stale_reap": [StaleProcess.objects.get().pk],
        "calibration:node": [data["desk"].name],
        "deployments:self_heal": [data["deployment"].pk],
        "chat:deployment": [data["deployment"].pk],
        "deployments:rpc_mode": [data["deployment"].pk],
        "deployments:recalibrate": [data["deployment"].pk],
        "nodes:rpc_cache_read": [data["attic"].name],
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
