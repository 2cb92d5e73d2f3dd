"""The dashboard's live regions: device gauges, running deployments with a speed sparkline from /metrics
samples, failed jobs of the last day, stale processes; the websocket that re-sends them on every change."""

from __future__ import annotations

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.urls import reverse
from django.utils import timezone

from deployments.charts import sparkline
from deployments.models import Deployment, DeploymentState, SpeedSample
from jobs import broadcast
from jobs.models import Job, JobState
from modelfiles.models import ModelFile
from nodes.models import DeviceKind
from tests.factories import DeviceFactory, NodeFactory

GIB = 2**30
NOW = timezone.now().replace(microsecond=0)


# -- The sparkline ---------------------------------------------------------------------------------------


def test_the_sparkline_spans_the_hour_left_to_right_and_zero_to_the_peak_bottom_to_top():
    samples = [(NOW - timedelta(minutes=60), 10.0), (NOW - timedelta(minutes=30), 20.0), (NOW, 5.0)]
    line = sparkline.sparkline(samples, NOW)
    # x from 2 to 158 over the hour; y from 30 (0 tok/s) to 2 (the peak, 20 tok/s).
    assert line.path == "M2 16L80 2L158 23"
    assert (line.count, line.last, line.peak, line.low) == (3, 5.0, 20.0, 5.0)


def test_idle_intervals_break_the_line_and_a_lone_sample_is_a_dot():
    samples = [
        (NOW - timedelta(minutes=50), 8.0),
        (NOW - timedelta(minutes=40), 8.0),
        (NOW - timedelta(minutes=30), None),  # nothing generated in that interval
        (NOW - timedelta(minutes=20), 4.0),
        (NOW - timedelta(minutes=10), None),
        (NOW - timedelta(hours=2), 99.0),  # older than the window: left out, and not the peak
    ]
    line = sparkline.sparkline(samples, NOW)
    assert line.path.count("M") == 1 and line.peak == 8.0
    assert line.dots == [(106.0, 16.0)]


def test_no_speed_in_the_window_draws_nothing():
    assert sparkline.sparkline([(NOW, None)], NOW).empty
    assert sparkline.sparkline([], NOW).path == ""


# -- Speed samples from /metrics -------------------------------------------------------------------------


@pytest.fixture
def running(db):
    desk = NodeFactory(name="desk", address="127.0.0.1", transport="local", may_coordinate=True)
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=16 * GIB, free_bytes=12 * GIB)
    model = ModelFile.objects.create(name="tiny", node=desk, path="/m/tiny.gguf", profile={})
    plan = {"placements": [{"node": "desk", "device": "CPU", "used_bytes": 4 * GIB}]}
    return Deployment.objects.create(name="tiny @ 4096", model_file=model, coordinator=desk, plan=plan,
                                     state=DeploymentState.RUNNING)  # fmt: skip


def metrics(tokens: float, seconds: float) -> dict[str, str]:
    return {"tokens_predicted_total": str(tokens), "tokens_predicted_seconds_total": str(seconds)}


def test_a_sample_is_the_speed_between_two_looks_at_the_counters(running):
    first = SpeedSample.record(running, metrics(64, 2.0), at=NOW - timedelta(minutes=2))
    assert first.tokens_per_s == 32.0  # since llama-server started (the deploy's measurement)
    idle = SpeedSample.record(running, metrics(64, 2.0), at=NOW - timedelta(minutes=1))
    assert idle.tokens_per_s is None
    busy = SpeedSample.record(running, metrics(64 + 300, 2.0 + 12.0), at=NOW)
    assert busy.tokens_per_s == 25.0
    restarted = SpeedSample.record(running, metrics(10, 1.0), at=NOW + timedelta(minutes=1))
    assert restarted.tokens_per_s == 10.0  # counters started again with the server
    assert SpeedSample.record(running, {"requests_processing": "0"}) is None


# -- The page, the polling fallback and the websocket ------------------------------------------------------


def test_the_dashboard_shows_gauges_sparklines_and_failed_jobs(running, viewer_client):
    for minutes, tps in ((40, 20.0), (20, 10.0), (1, 15.0)):
        SpeedSample.objects.create(deployment=running, at=timezone.now() - timedelta(minutes=minutes),
                                   tokens_per_s=tps)  # fmt: skip
    failed = Job.objects.create(kind="command", node=running.coordinator, state=JobState.FAILED,
                                finished_at=timezone.now(), result="exit status 1")  # fmt: skip
    Job.objects.create(kind="command", state=JobState.FAILED, finished_at=timezone.now() - timedelta(days=2))
    html = viewer_client.get(reverse("dashboard")).content.decode()
    gauges = html.split('id="dash-nodes"')[1].split("</section>")[0]
    assert 'data-node="desk"' in gauges and "tiny @ 4096</a> 4.0 GiB · 25%" in gauges
    row = html.split(f'id="dash-deployment-{running.pk}"')[1].split("</li>")[0]
    assert '<svg class="sparkline"' in row and '<path d="M' in row and "15.0 tok/s" in row
    failures = html.split('id="dash-failed-jobs"')[1].split("</section>")[0]
    assert f'id="dash-failed-{failed.pk}"' in failures and "exit status 1" in failures
    assert failures.count("<li") == 1  # the one from two days ago is not shown
    assert 'ws-connect="/ws/dashboard/"' in html
    assert "style=" not in html.split('id="dashboard-live"')[1]


def test_the_polling_fallback_answers_every_region_out_of_band(running, viewer_client):
    html = viewer_client.get(reverse("dashboard_live"), headers={"HX-Request": "true"}).content.decode()
    for region in ("dash-deployments", "dash-nodes", "dash-failed-jobs", "stale-processes"):
        assert f'id="{region}" hx-swap-oob="outerHTML"' in html
    assert "<html" not in html


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_socket_sends_the_regions_again_when_a_job_fails(viewer_user):
    from channels.db import database_sync_to_async

    from tests.sockets import connect

    job = Job.objects.create(kind="command", node=NodeFactory(name="attic"), state=JobState.RUNNING)

    async def scenario() -> tuple[str, str]:
        socket, connected, _ = await connect("/ws/dashboard/", viewer_user)
        assert connected
        first = await socket.receive_from(timeout=15)  # the regions as they are at connect time
        await database_sync_to_async(job.finish)(JobState.FAILED, result="it broke")
        await broadcast.send_status(job.pk, job.state)
        again = await socket.receive_from(timeout=15)
        await socket.disconnect()
        return first, again

    first, again = async_to_sync(scenario)()
    assert f'id="dash-failed-{job.pk}"' not in first
    assert f'id="dash-failed-{job.pk}"' in again and "it broke" in again
    assert 'id="dash-failed-jobs" hx-swap-oob="outerHTML"' in again


@pytest.mark.django_db(transaction=True)
def test_strangers_get_no_dashboard_socket(stranger_user):
    from tests.sockets import connect

    async def scenario() -> bool:
        socket, connected, _ = await connect("/ws/dashboard/", stranger_user)
        await socket.disconnect()
        return connected

    assert not async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_socket_follows_a_deployments_state(viewer_user):
    from channels.db import database_sync_to_async

    from tests.sockets import connect

    desk = NodeFactory(name="desk", address="127.0.0.1", transport="local", may_coordinate=True)
    model = ModelFile.objects.create(name="tiny", node=desk, path="/m/tiny.gguf", profile={})
    deployment = Deployment.objects.create(name="tiny @ 512", model_file=model, coordinator=desk, plan={},
                                           state=DeploymentState.RUNNING)  # fmt: skip

    async def scenario() -> tuple[str, str]:
        socket, connected, _ = await connect("/ws/dashboard/", viewer_user)
        assert connected
        first = await socket.receive_from(timeout=15)
        # As the monitor does it: the model's state change tells the deployment's page and the dashboard.
        await database_sync_to_async(deployment.mark_degraded)("llama-server does not answer")
        again = await socket.receive_from(timeout=15)
        await socket.disconnect()
        return first, again

    first, again = async_to_sync(scenario)()
    row = f'id="dash-deployment-{deployment.pk}"'
    assert row in first and "Running" in first.split(row)[1].split("</li>")[0]
    # Not working any more: out of the running list, into its own with what happened in a sentence.
    assert row not in again
    down = again.split(f'id="dash-down-{deployment.pk}"')[1].split("</li>")[0]
    assert "Degraded" in down and "tiny @ 512 is not working: llama-server does not answer." in down


# -- The memory tile and the bars say the same ------------------------------------------------------------


def _free_label(bar) -> int:
    return next(seg.bytes for seg in bar.segments if seg.kind == "free")


@pytest.mark.django_db
def test_the_memory_tile_and_the_device_bars_give_the_same_free_memory(admin_client):
    probed = NOW - timedelta(minutes=10)
    desk = NodeFactory(name="desk", may_coordinate=True, last_seen_at=probed)
    DeviceFactory(node=desk, name="CPU", total_bytes=16 * GIB, free_bytes=10 * GIB)  # 6 GiB in use then
    pc = NodeFactory(name="pc", last_seen_at=probed)
    DeviceFactory(node=pc, name="CPU", total_bytes=8 * GIB, free_bytes=7 * GIB)
    model = ModelFile.objects.create(name="tiny", node=desk, path="/m/tiny.gguf", profile={})
    placements = [{"node": "desk", "device": "CPU", "used_bytes": 2 * GIB}]
    # Started after the probe: its 2 GiB were free then, and are not now.
    plan = {"placements": placements}
    Deployment.objects.create(name="after", model_file=model, coordinator=desk, plan=plan,
                              state=DeploymentState.RUNNING, started_at=NOW)  # fmt: skip

    response = admin_client.get(reverse("dashboard"))
    gauges, memory = response.context["gauges"], response.context["memory"]
    bars = {g["node"].name: g["devices"][0]["bar"] for g in gauges}
    assert _free_label(bars["desk"]) == 8 * GIB  # 16, less 6 in use at the probe, less 2 the deployment holds
    assert [(s.kind, s.bytes) for s in bars["desk"].segments] == [("d0", 2 * GIB), ("others", 6 * GIB),
                                                                   ("free", 8 * GIB)]  # fmt: skip
    assert _free_label(bars["pc"]) == 7 * GIB
    assert memory == {"total": 24 * GIB, "free": 15 * GIB, "devices": 2}
    body = response.content.decode()
    tile = body.split('id="dash-memory"', 1)[1].split("</div></div>", 1)[0]
    assert "24.0 GiB" in tile and "15.0 GiB free on 2 devices" in tile
    # The tile is a live region too: the socket and the poll send it with the bars.
    live = admin_client.get(reverse("dashboard_live")).content.decode()
    assert 'id="dash-memory" hx-swap-oob="outerHTML"' in live and "15.0 GiB free" in live


@pytest.mark.django_db
def test_a_deployment_running_at_the_probe_is_not_counted_twice_and_a_crashed_one_frees_its_memory(
    admin_client,
):
    probed = NOW - timedelta(minutes=10)
    desk = NodeFactory(name="desk", may_coordinate=True, last_seen_at=probed)
    DeviceFactory(node=desk, name="CPU", total_bytes=16 * GIB, free_bytes=10 * GIB)  # it held 4 of the 6
    model = ModelFile.objects.create(name="tiny", node=desk, path="/m/tiny.gguf", profile={})
    process = {"node": "desk", "role": "llama-server", "pid": 4242, "port": 8080, "log": "/l"}
    deployment = Deployment.objects.create(
        name="before", model_file=model, coordinator=desk, state=DeploymentState.RUNNING,
        plan={"placements": [{"node": "desk", "device": "CPU", "used_bytes": 4 * GIB}]},
        started_at=probed - timedelta(minutes=5), processes={"llama-server@desk": process},
    )  # fmt: skip

    def desk_bar():
        context = admin_client.get(reverse("dashboard")).context
        return context["gauges"][0]["devices"][0]["bar"], context["memory"]

    bar, memory = desk_bar()
    assert [(s.kind, s.bytes) for s in bar.segments] == [
        ("d0", 4 * GIB),
        ("others", 2 * GIB),
        ("free", 10 * GIB),
    ]
    assert memory["free"] == 10 * GIB

    # The monitor finds llama-server gone: the deployment holds nothing any more.
    deployment.record_live_status({"checked_at": NOW.isoformat(), "processes": [{**process, "alive": False}]})
    deployment.mark_degraded("llama-server on desk (PID 4242) is not running.")
    bar, memory = desk_bar()
    assert [(s.kind, s.bytes) for s in bar.segments] == [("others", 2 * GIB), ("free", 14 * GIB)]
    assert memory["free"] == 14 * GIB
