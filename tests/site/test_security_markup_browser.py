"""In Chromium: the finding of issue 17 replayed. A node's device carries the GPU "name" a fake nvidia-smi
printed; an admin opens that node's speed-figures page, whose form shows the name as a help text. Before the
fix htmx turned it into a POST to /users/new/ with the admin's session and CSRF header (a new admin with a
known password); now no request leaves the page after it loaded, and no user is made.

Also: the job log, which carries hx-disable, still loads its earlier lines through htmx (its control moved
above the log for that)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from jobs.models import Job, JobState
from nodes.models import Device, DeviceKind
from tests.browser import log_in
from tests.factories import PASSWORD, NodeFactory, UserFactory

pytestmark = [pytest.mark.browser]

# What `nvidia-smi --query-gpu=name` printed, as in the issue: a whole user-creation form in under 200
# characters (Device.description's length, so it is stored whole).
GPU_NAME = (
    "<i hx-post=/users/new/ hx-trigger=load></i><input name=username value=eve>"
    "<input name=password1 value=Eve-pass-1234><input name=password2 value=Eve-pass-1234>"
    "<input name=role value=admin>"
)
QUIET_MS = 2000


@pytest.mark.security
def test_a_device_name_from_a_node_sends_no_request_from_the_speed_figures_page(live_server_url, page):
    assert len(GPU_NAME) <= 200
    admin = UserFactory(username="ada-admin", role="admin")
    node = NodeFactory(name="tower")
    # Stored as the probe would store it: cleaning keeps printable text such as this, only pages escape it.
    Device.objects.create(node=node, name="CUDA0", kind=DeviceKind.CUDA, description=GPU_NAME,
                          total_bytes=24 * 2**30, free_bytes=23 * 2**30, bandwidth_gbs=936.0)  # fmt: skip
    users_before = set(get_user_model().objects.values_list("username", flat=True))
    log_in(page, live_server_url, admin.username, PASSWORD)

    requests: list[tuple[str, str]] = []
    page.on("request", lambda request: requests.append((request.method, request.url)))
    url = f"{live_server_url}/nodes/{node.name}/bandwidth/"
    page.goto(url)
    page.wait_for_load_state("networkidle")
    at_load = len(requests)
    page.wait_for_timeout(QUIET_MS)  # `hx-trigger=load` (or anything slower) would have fired by now

    after_load = requests[at_load:]
    assert not after_load, f"Requests left the page after it loaded: {after_load}"
    static = f"{live_server_url}/static/"
    others = [(m, u) for m, u in requests if not (m == "GET" and (u == url or u.startswith(static)))]
    assert not others, f"The page load asked for more than itself and its static files: {others}"
    # The name is on the page, as text.
    expect(page.locator(f"#field-device_{node.devices.get().pk} .help")).to_contain_text(
        "<i hx-post=/users/new/ hx-trigger=load></i><input name=username value=eve>"
    )
    assert page.locator("input[name=username], input[name=role]").count() == 0
    assert set(get_user_model().objects.values_list("username", flat=True)) == users_before


def test_the_job_log_loads_its_earlier_lines_in_place(live_server_url, page):
    UserFactory(username="vera-viewer", role="viewer")
    node = NodeFactory(name="attic", address="192.0.2.7")
    job = Job.objects.create(kind="command", node=node, title="long", state=JobState.SUCCEEDED)
    job.append_lines([("out", f"line {i}") for i in range(1200)])
    log_in(page, live_server_url, "vera-viewer", PASSWORD)
    page.goto(f"{live_server_url}/jobs/{job.pk}/")
    page.evaluate("window.__notReloaded = true")
    log = page.locator(f"#job-log-{job.pk}")
    expect(log.locator("[data-seq]")).to_have_count(500)
    control = page.locator(f"#load-earlier-{job.pk}")
    control.click()
    expect(log.locator("[data-seq]")).to_have_count(1000)
    expect(control).to_have_attribute("href", f"/jobs/{job.pk}/?before=200")
    control.click()
    expect(log.locator("[data-seq]")).to_have_count(1200)
    expect(control).to_have_count(0)
    seqs = page.eval_on_selector_all(f"#job-log-{job.pk} [data-seq]", "els => els.map(e => e.dataset.seq)")
    assert seqs == [str(i) for i in range(1200)]
    assert page.evaluate("window.__notReloaded") is True
