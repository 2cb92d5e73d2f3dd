"""In a real browser, under the console's Content-Security-Policy: every page loads and runs its scripts, htmx
and its websockets with nothing blocked and no eval asked for; polling and plain confirm forms still work
without inline script. (Every other browser test fails on a violation too: tests/browser.py's `page`.)"""

from __future__ import annotations

import pytest
from django.urls import reverse
from playwright.sync_api import expect

from jobs.models import Job, JobState
from nodes.models import Credential
from tests.browser import csp_problems, log_in
from tests.factories import PASSWORD, CredentialFactory, NodeFactory, UserFactory
from tests.household import household_pages

pytestmark = [pytest.mark.browser, pytest.mark.security]


def _policy(response) -> str:
    policy = response.headers.get("content-security-policy", "")
    assert "script-src 'self' 'nonce-" in policy and "unsafe-eval" not in policy, policy
    return policy


def test_every_page_runs_with_no_csp_violation(live_server_url, page, household):
    log_in(page, live_server_url, household["admin"].username, PASSWORD)
    pages = {
        **household_pages(household),
        "admin": reverse("admin:index"),
        "admin users": "/admin/auth/user/",
    }
    for name, path in pages.items():
        seen = len(page.console_messages_seen)
        response = page.goto(live_server_url + path)
        _policy(response)
        page.wait_for_load_state("networkidle")
        # htmx is there, with eval off (from <meta name="htmx-config">).
        if not name.startswith("admin"):  # Django's admin has no htmx
            state = page.evaluate("() => window.htmx ? htmx.config.allowEval : 'no htmx'")
            assert state is False, f"{name}: htmx.config.allowEval is {state}"
        problems = csp_problems(page.console_messages_seen[seen:])
        assert not problems, f"{name}: {problems}"
    # The websocket pages opened their sockets under connect-src 'self'.
    page.goto(live_server_url + reverse("deployments:run", args=[household["deployment"].pk]))
    expect(page.locator("[data-job-socket]").first).to_have_attribute("data-ws-open", "1")


# A socket that never opens: the page must fall back to polling.
NO_WEBSOCKETS = """
window.WebSocket = function () {
  return { readyState: 0, send() {}, close() {}, addEventListener() {}, removeEventListener() {} };
};
"""


def test_a_job_page_polls_for_new_lines_without_eval_while_its_socket_is_down(live_server_url, page):
    UserFactory(username="vera-viewer", role="viewer")
    node = NodeFactory(name="attic", address="192.0.2.7")
    job = Job.objects.create(kind="command", node=node, title="long job", state=JobState.RUNNING)
    job.append_lines([("out", "first line")])
    page.context.add_init_script(NO_WEBSOCKETS)
    polls = []
    page.on("request", lambda request: "after=" in request.url and polls.append(request.url))
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/jobs/{job.pk}/")
    expect(page.locator(f"#job-log-{job.pk}")).to_contain_text("first line")
    job.append_lines([("out", "second line, fetched by a poll")])
    expect(page.locator(f"#job-log-{job.pk}")).to_contain_text("second line, fetched by a poll")
    assert any("after=0" in url for url in polls), polls  # the cursor: the seq of the last line shown


def test_a_form_that_asks_first_still_asks_without_inline_script(live_server_url, page):
    UserFactory(username="alice-admin", role="admin")
    CredentialFactory(name="old-key")
    log_in(page, live_server_url, "alice-admin", PASSWORD)
    page.goto(live_server_url + reverse("nodes:credentials"))
    asked = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.locator("form[data-confirm] button").click()
    page.wait_for_timeout(300)
    assert asked == ["Delete credential old-key?"] and Credential.objects.filter(name="old-key").exists()
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("form[data-confirm] button").click()
    expect(page.locator(".message")).to_contain_text("old-key")
    assert not Credential.objects.filter(name="old-key").exists()


def test_the_policy_blocks_injected_script_and_eval_and_the_tests_would_notice(live_server_url, page):
    """What the other browser tests rely on: an inline script without the nonce is blocked and reported, and
    htmx refuses an expression that needs eval, also reported."""
    UserFactory(username="vera-viewer", role="viewer")
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(live_server_url + reverse("jobs:list"))
    seen = len(page.console_messages_seen)
    page.evaluate(
        """() => {
        const script = document.createElement("script");
        script.textContent = "window.__injected = true";
        document.body.append(script);
        const button = document.createElement("button");
        button.id = "needs-eval";
        button.setAttribute("hx-get", "/jobs/");
        button.setAttribute("hx-trigger", "click[window.__injected = true]");
        document.body.append(button);
        htmx.process(button);
    }"""
    )
    page.click("#needs-eval")
    page.wait_for_timeout(500)
    assert page.evaluate("() => window.__injected") is None  # neither ran
    caught = csp_problems(page.console_messages_seen[seen:])
    assert any("CSP violation: script-src" in text for text in caught), caught
    assert any("htmx:evalDisallowedError" in text for text in caught), caught
    del page.console_messages_seen[seen:]  # expected here: the fixture checks for anything else
