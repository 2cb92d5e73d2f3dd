"""Browser testing: a live ASGI server (daphne, websockets included) and headless Chromium via Playwright.

Playwright cannot download browsers here; it drives Debian's `chromium` through `executable_path`. Without
Chromium the browser tests skip with the reason, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import shutil
import threading
from functools import partial
from pathlib import Path

import pytest
from channels.testing.live import make_application
from daphne.testing import DaphneProcess
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from playwright.sync_api import expect

from tests.unavailable import unavailable

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


_INHERITED_CONNECTIONS: list = []


def _prepare_forked_server() -> None:
    """Runs in the forked server before it serves: give it its own database connections and threads.

    The settings already name the test database (pytest-django switched them before the fork). Closing an
    inherited connection would end the parent's session too, so we only drop it, keeping a reference so
    garbage collection never closes it either. asgiref's process-wide database thread does not survive a
    fork: an inherited executor whose only thread is missing would make every database call wait forever.
    """
    from concurrent.futures import ThreadPoolExecutor

    from asgiref.sync import SyncToAsync
    from django.db import connections

    SyncToAsync.single_thread_executor = ThreadPoolExecutor(max_workers=1)
    for connection in connections.all(initialized_only=True):
        _INHERITED_CONNECTIONS.append(connection.connection)
        connection.connection = None


@pytest.fixture(scope="session")
def browser():
    executable = chromium_path()
    if executable is None:
        unavailable("Chromium is not installed (make test installs Debian's chromium when it can).")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the test's own ORM calls are still plain
    # synchronous code, so Django's async-safety guard would be a false alarm here.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        yield instance
        instance.close()


@pytest.fixture
def live_server_url(transactional_db, settings):
    """A real daphne serving the ASGI app (HTTP and websockets) against the test database."""
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "localhost", "127.0.0.1"]
    get_application = partial(make_application, static_wrapper=ASGIStaticFilesHandler)
    process = DaphneProcess("127.0.0.1", get_application, setup=_prepare_forked_server)
    process.start()
    if not process.ready.wait(timeout=30):
        process.terminate()
        raise RuntimeError("The live daphne server did not start in 30 s.")
    yield f"http://127.0.0.1:{process.port.value}"
    process.terminate()
    process.join(timeout=10)


# Every page a browser test opens reports what the Content-Security-Policy blocked (and htmx any eval it was
# denied) on the console; the `page` fixture fails the test when there was any.
REPORT_CSP_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (event) => {
  console.error(`CSP violation: ${event.violatedDirective} blocked ${event.blockedURI || "inline"} ` +
                `in ${event.sourceFile || document.location.pathname}:${event.lineNumber}`);
});
// htmx reports an eval it was denied (allowEval is off) as an event only: say it on the console too.
document.addEventListener("htmx:evalDisallowedError", (event) => {
  console.error(`htmx:evalDisallowedError on ${event.target.outerHTML.slice(0, 200)}`);
});
"""
CSP_PROBLEMS = ("CSP violation", "Content Security Policy", "htmx:evalDisallowedError")


def csp_problems(messages: list[str]) -> list[str]:
    return [text for text in messages if any(marker in text for marker in CSP_PROBLEMS)]


# The same patience for `expect` as for actions (the context's default below): on a two-core machine busy with
# a build beside the suite, a page's answer can take longer than Playwright's 5 s.
expect.set_options(timeout=15_000)


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    context.add_init_script(REPORT_CSP_VIOLATIONS)
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    page.console_messages_seen = console
    yield page
    context.close()
    problems = csp_problems(console)
    assert not problems, f"The page broke its Content-Security-Policy: {problems}"


def log_in(page, base_url: str, username: str, password: str) -> None:
    page.goto(f"{base_url}/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base_url}/")


# The README's pictures (docs/screenshots/, `make screenshots`): the browser tests that reach a page worth
# showing save it at both widths. With RAMDECK_SCREENSHOTS_DIR set they go there; otherwise into the test's
# tmp_path, so a normal run never touches the repository.
SCREENSHOT_WIDTHS = (1280, 390)
SCREENSHOT_MAX_HEIGHT = 2400


def screenshot_dir(tmp_path) -> Path:
    folder = Path(os.environ.get("RAMDECK_SCREENSHOTS_DIR") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_screenshots(page, folder: Path, name: str, *, selector: str | None = None) -> list[Path]:
    """`NAME-1280.png` and `NAME-390.png`: the page (from its top, at most SCREENSHOT_MAX_HEIGHT px) as a
    desktop and a phone show it, or only the element `selector` when given. The window is made as tall as the
    page rather than using Playwright's full_page, which widens the shot to boxes that scroll sideways; it is
    put back afterwards."""
    viewport = page.viewport_size
    saved = []
    try:
        for width in SCREENSHOT_WIDTHS:
            page.set_viewport_size({"width": width, "height": viewport["height"]})
            page.wait_for_timeout(200)  # the layout settles (the menu collapses, gauges redraw)
            path = folder / f"{name}-{width}.png"
            if selector:
                page.locator(selector).screenshot(path=path)
            else:
                height = min(page.evaluate("document.documentElement.scrollHeight"), SCREENSHOT_MAX_HEIGHT)
                page.set_viewport_size({"width": width, "height": max(height, viewport["height"])})
                page.evaluate("window.scrollTo(0, 0)")  # the clip is taken from the window's top
                page.screenshot(path=path, clip={"x": 0, "y": 0, "width": width, "height": height})
            assert path.stat().st_size > 0, path
            saved.append(path)
    finally:
        page.set_viewport_size(viewport)
    return saved


def in_own_thread(function, *args, timeout: float = 300):
    """`function(*args)` on a thread of its own, its result or its exception: Playwright's sync API keeps an
    event loop on the test's thread, and the job runner (asyncio.run) wants one of its own."""
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(timeout=timeout)
    if thread.is_alive():
        raise TimeoutError(f"{function.__name__} did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def checklist_ticks(page) -> set[str]:
    """The keys of the dashboard's first-run steps shown as done."""
    items = page.locator("#first-run li.done")
    return {items.nth(i).get_attribute("id").removeprefix("first-run-") for i in range(items.count())}
