"""As a new operator would, in a real browser: plan → confirm → deploy → watch the steps and a live log →
running → stop, with a real Celery worker running the jobs on three lab hosts over real sshd and real
llama.cpp. Nothing of the deployment is left running afterwards."""

from __future__ import annotations

import threading

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from deployments.models import Deployment, DeploymentState
from jobs.models import Job, JobState
from llamacpp.gguf import profile_path
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import Device, DeviceKind
from tests.browser import log_in
from tests.deploy_fixtures import (
    lab_node,
    listeners_in,
    log_text,
    pid_alive,
    route_between,
    run,
)
from tests.factories import PASSWORD, UserFactory
from tests.job_fixtures import CeleryWorker
from tests.llamacpp_build import TARBALL, use_cached_llamacpp

pytestmark = [pytest.mark.browser, pytest.mark.lab, pytest.mark.e2e, pytest.mark.timeout(1200)]
MIB = 2**20


@pytest.fixture
def celery_worker(transactional_db, tmp_path):
    worker = CeleryWorker(tmp_path, default_queue=True).start()
    yield worker
    worker.stop()


@pytest.fixture
def live_url(celery_worker, live_server_url):
    """The live server, forked after the worker's queue became the default one."""
    return live_server_url


@pytest.fixture
def cluster(transactional_db, lab, lab_hosts, tmp_path, settings):
    use_cached_llamacpp(settings)  # builds upload the pinned source and find it compiled
    hosts = lab_hosts(3)
    route_between(hosts)
    now = timezone.now()
    coordinator = lab_node(lab, hosts[0], name="desk", may_coordinate=True, last_seen_at=now, rtt_ms=0.1)
    workers = [
        lab_node(lab, h, name=f"old-pc-{i}", last_seen_at=now, rtt_ms=0.1) for i, h in enumerate(hosts[1:], 1)
    ]
    Device.objects.create(node=coordinator, name="CPU", kind=DeviceKind.CPU, total_bytes=24000 * MIB,
                          free_bytes=24000 * MIB, bandwidth_gbs=2.0)  # fmt: skip
    for worker in workers:
        Device.objects.create(node=worker, name="CPU", kind=DeviceKind.CPU, total_bytes=12 * MIB,
                              free_bytes=12 * MIB, bandwidth_gbs=40.0)  # fmt: skip
    for node in [coordinator, *workers]:
        job = Job.objects.create(
            kind="build", node=node, params={"source": "tarball", "tarball": str(TARBALL)}
        )
        # Playwright's sync API keeps an event loop on this thread; the runner wants one of its own.
        thread = threading.Thread(target=run, args=(job,))
        thread.start()
        thread.join(timeout=300)
        job.refresh_from_db()
        assert job.state == JobState.SUCCEEDED, job.result
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama(n_layer=8, n_embd=256))
    profile = profile_path(path)
    model = ModelFile.objects.create(
        name="tiny", node=coordinator, path=str(path), size_bytes=profile["size_bytes"], profile=profile
    )
    return {"hosts": hosts, "model": model}


def test_an_operator_plans_deploys_watches_and_stops(cluster, celery_worker, live_url, page):
    model = cluster["model"]
    UserFactory(username="oscar-operator", role="operator")
    log_in(page, live_url, "oscar-operator", PASSWORD)

    page.goto(f"{live_url}/models/")
    expect(page.locator(f"#model-{model.pk}")).to_contain_text("fits")
    page.goto(f"{live_url}/models/{model.pk}/plan/")
    page.fill("input[name=ctx]", "512")
    expect(page.locator("#server-command")).to_contain_text("-c 512")
    page.fill("input[name=name]", "tiny on the lab")
    page.click("#confirm-plan")
    expect(page.locator("#deployment-state")).to_have_text("Confirmed")
    deployment = Deployment.objects.get()
    assert {p["node"] for p in deployment.plan["placements"] if p["endpoint"]} == {"old-pc-1", "old-pc-2"}

    page.click("text=Run and live status")
    page.click("#deploy-button")
    try:
        expect(page.locator("#deployment-state")).to_have_text("Running", timeout=180_000)
    except AssertionError:
        deployment.refresh_from_db()
        steps = [(s.name, s.job.state, s.job.result) for s in deployment.steps.select_related("job")]
        raise AssertionError(f"{deployment.state}: {deployment.state_reason}; steps: {steps}") from None
    expect(page.locator("#steps")).to_contain_text("Start llama-server on desk")
    expect(page.locator("#verification")).to_contain_text("matches")
    expect(page.locator("#speed")).to_contain_text("Measured")

    # Watch a step's log on its own page (the live job log), then come back.
    run_url = page.url
    page.click("text=Start ggml-rpc-server on old-pc-1")
    expect(page.locator("body")).to_contain_text("Starting RPC server v7.0.0")
    # The page shows what the monitor saw (a page view never reaches a node): one round, as beat runs it.
    page.goto(run_url)
    expect(page.locator("#processes")).to_contain_text("Not checked yet")
    from deployments import monitor

    assert monitor.check_all() == []
    page.goto(run_url)
    expect(page.locator("#processes")).to_contain_text("alive")
    expect(page.locator("#processes")).to_contain_text("As of")
    expect(page.locator("#metrics-sentences")).to_contain_text("Since it started it has written")  # /metrics
    # The dashboard: the deployment's speed from that look at /metrics (the measure step's tokens), and what
    # it holds on each node's devices.
    page.goto(f"{live_url}/")
    row = page.locator(f"#dash-deployment-{deployment.pk}")
    expect(row.locator("svg.sparkline")).to_have_count(1)
    expect(row).to_contain_text("tok/s")
    expect(page.locator('[data-node="old-pc-1"] .bar-labels')).to_contain_text("tiny on the lab")
    page.goto(run_url)

    # The plan was confirmed with llama-server's default host (loopback); a remote coordinator binds to
    # its own address instead, and that is the endpoint people are given.
    expect(page.locator("#endpoint-url")).to_have_text(f"http://{cluster['hosts'][0].address}:8080")
    page.click("text=Show API key and example")
    deployment.refresh_from_db()
    expect(page.locator("#api-key")).to_have_value(deployment.api_key())
    expect(page.locator("#curl-example")).to_contain_text("/completion")

    page.click("#stop-button")
    page.click("#confirm-stop")  # Stop asks first
    expect(page.locator("#deployment-state")).to_have_text("Stopped", timeout=120_000)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.STOPPED, celery_worker.log()[-3000:]
    for info in deployment.processes.values():
        assert not pid_alive(int(info["pid"])), info
    for host in cluster["hosts"]:
        assert listeners_in(host, 50052) == "" and listeners_in(host, deployment.port) == ""
    stop = deployment.steps.get(name="stop", job__node__name="desk").job
    assert "llama-server PID" in log_text(stop)
