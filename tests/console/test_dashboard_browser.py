"""In a real browser: the dashboard updates live when a job fails elsewhere (no reload).

The job fails through the real runner in the test process, on the local transport; the dashboard is served
by the live daphne, whose websocket consumer hears the runner through the real Redis channel layer."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from jobs import runner
from jobs.models import JobState
from tests.browser import log_in
from tests.factories import PASSWORD, UserFactory
from tests.job_fixtures import python_job

pytestmark = pytest.mark.browser


def test_the_dashboard_shows_a_job_that_fails_elsewhere_without_a_reload(
    channel_layer, local_node, live_server_url, page
):
    UserFactory(username="vera-viewer", role="viewer")
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    expect(page.locator('[data-job-socket="dashboard"]')).to_have_attribute("data-ws-open", "1")
    expect(page.locator("#dash-failed-jobs")).to_contain_text("None.")
    page.evaluate("window.__notReloaded = true")

    job = python_job(local_node, "import sys; print('the disk is full', flush=True); sys.exit(3)")
    assert runner.run_job(job.pk)  # the runner of this process, as a worker would run it
    job.refresh_from_db()
    assert job.state == JobState.FAILED

    failed = page.locator(f"#dash-failed-{job.pk}")
    expect(failed).to_be_visible()
    expect(failed).to_contain_text("Failed")
    expect(page.locator("#dash-failed-jobs")).not_to_contain_text("None.")
    assert page.evaluate("window.__notReloaded") is True
