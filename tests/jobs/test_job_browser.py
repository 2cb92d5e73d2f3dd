"""In a real browser: a job's log arrives live (no reload) and its badge turns to succeeded.

The job runs through the real runner (in a thread of the test process) on the local transport; the page
is served by the live daphne, which hears the runner through the real Redis channel layer.
"""

from __future__ import annotations

import re
import threading

import pytest
from playwright.sync_api import expect

from jobs import runner
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory
from tests.job_fixtures import python_job

pytestmark = pytest.mark.browser


def _job_waiting_for(node, go):
    code = (
        "import os, time\n"
        "print('first line from the node', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "print('\\x1b[32msecond line\\x1b[0m <done>', flush=True)\n"
    )
    return python_job(node, code)


def _run_in_background(job):
    thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
    thread.start()
    return thread


def test_a_watcher_sees_the_log_arrive_live_and_the_badge_turn_to_succeeded(
    channel_layer, local_node, live_server_url, page, tmp_path
):
    # The job runs on the console's own host, whose logs are the admins'.
    UserFactory(username="alice-admin", role="admin")
    go = tmp_path / "go"
    job = _job_waiting_for(local_node, go)
    log_in(page, live_server_url, "alice-admin", PASSWORD)
    page.goto(f"{live_server_url}/jobs/{job.pk}/")
    expect(page.locator(f'[data-job-socket="{job.pk}"]')).to_have_attribute("data-ws-open", "1")
    page.evaluate("window.__notReloaded = true")

    thread = _run_in_background(job)
    try:
        log = page.locator(f"#job-log-{job.pk}")
        expect(log).to_contain_text("first line from the node")
        expect(page.locator(f"#job-badge-{job.pk}")).to_have_text("Running")
        go.touch()
        expect(log).to_contain_text("second line <done>")
        expect(page.locator(f"#job-badge-{job.pk}")).to_have_text("Succeeded")
        expect(page.locator(f"#job-badge-{job.pk}")).to_have_class("badge succeeded")
    finally:
        go.touch()
        thread.join(timeout=60)
    assert page.evaluate("window.__notReloaded") is True
    # The colour codes the program printed are not shown (the echoed command line shows its source).
    assert log.locator("div.out").all_inner_texts() == ["first line from the node", "second line <done>"]
    # Each line once: the socket and the polling fallback never doubled one.
    seqs = page.eval_on_selector_all(f"#job-log-{job.pk} [data-seq]", "els => els.map(e => e.dataset.seq)")
    assert seqs == [str(i) for i in range(len(seqs))]


def test_the_job_list_badge_turns_to_succeeded_without_a_reload(
    channel_layer, local_node, live_server_url, page, tmp_path
):
    UserFactory(username="vera-viewer", role="viewer")
    go = tmp_path / "go"
    job = _job_waiting_for(local_node, go)
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/jobs/")
    expect(page.locator('[data-job-socket="list"]')).to_have_attribute("data-ws-open", "1")
    badge = page.locator(f"#job-badge-{job.pk}")
    expect(badge).to_have_text("Queued")
    page.evaluate("window.__notReloaded = true")
    thread = _run_in_background(job)
    try:
        expect(badge).to_have_text("Running")
        go.touch()
        expect(badge).to_have_text("Succeeded")
    finally:
        go.touch()
        thread.join(timeout=60)
    assert page.evaluate("window.__notReloaded") is True


def test_a_job_queued_after_the_list_loaded_appears_on_it_when_it_starts(
    channel_layer, local_node, live_server_url, page, tmp_path
):
    UserFactory(username="vera-viewer", role="viewer")
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/jobs/")
    expect(page.locator('[data-job-socket="list"]')).to_have_attribute("data-ws-open", "1")
    expect(page.locator("#job-table")).to_contain_text("No jobs yet.")
    page.evaluate("window.__notReloaded = true")
    go = tmp_path / "go"
    job = _job_waiting_for(local_node, go)
    thread = _run_in_background(job)
    try:
        expect(page.locator(f"#job-row-{job.pk}")).to_be_visible()
        go.touch()
        expect(page.locator(f"#job-badge-{job.pk}")).to_have_text("Succeeded")
    finally:
        go.touch()
        thread.join(timeout=60)
    assert page.evaluate("window.__notReloaded") is True


def test_without_a_websocket_the_page_polls_until_the_job_ends(
    channel_layer, local_node, live_server_url, page, tmp_path
):
    """A proxy that refuses websockets: the log and the badge still arrive, by polling, which then stops."""
    # The job runs on the console's own host, whose logs are the admins'.
    UserFactory(username="alice-admin", role="admin")
    go = tmp_path / "go"
    job = _job_waiting_for(local_node, go)
    page.route_web_socket("**/ws/**", lambda ws: ws.close(code=1008))
    polls: list[str] = []
    page.on("request", lambda request: polls.append(request.url) if "after=" in request.url else None)
    log_in(page, live_server_url, "alice-admin", PASSWORD)
    page.goto(f"{live_server_url}/jobs/{job.pk}/")
    page.evaluate("window.__notReloaded = true")
    thread = _run_in_background(job)
    try:
        log = page.locator(f"#job-log-{job.pk}")
        expect(log).to_contain_text("first line from the node")
        go.touch()
        expect(log).to_contain_text("second line <done>")
        expect(page.locator(f"#job-badge-{job.pk}")).to_have_text("Succeeded")
    finally:
        go.touch()
        thread.join(timeout=60)
    assert polls and page.evaluate("window.__notReloaded") is True
    seqs = page.eval_on_selector_all(f"#job-log-{job.pk} [data-seq]", "els => els.map(e => e.dataset.seq)")
    assert seqs == [str(i) for i in range(len(seqs))]
    # The finished summary carries no trigger: polling has stopped.
    expect(page.locator(f"#job-summary-{job.pk}")).not_to_have_attribute("hx-trigger", re.compile(".*"))
