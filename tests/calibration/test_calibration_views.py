"""Calibration on the node pages: the figures beside the table's, stale marks, the calibrate buttons, and the
admin's override form (audited; viewers and operators refused)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEvent
from builds.models import Build
from jobs.models import Job
from nodes.models import Device, Reachability
from tests.factories import DeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_broker(monkeypatch):
    sent: list[int] = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: sent.append(job.pk))
    return sent


def calibrated_cpu(**fields) -> Device:
    node = NodeFactory(
        name=fields.pop("node_name", "old-pc"),
        reachability=Reachability.REACHABLE,
        last_seen_at=timezone.now(),
        facts={"cpu_cores": 4, "cpu_quota_cores": None},
        calibrated_at=timezone.now(),
        pass_overhead_ms=1.25,
        rpc_hop_ms=0.4,
        link_rtt_ms=0.31,
        link_throughput_mbs=112.0,
    )
    device = DeviceFactory(node=node, name="CPU", description="Intel(R) Core(TM) i5-6500", bandwidth_gbs=35.0)
    device.record_measurement(bandwidth_gbs=fields.pop("measured", 9.5), overhead_ms=1.6)
    Device.objects.filter(pk=device.pk).update(**fields)
    device.refresh_from_db()
    return device


def test_the_node_page_shows_the_measured_figure_beside_the_tables(viewer_client):
    device = calibrated_cpu()
    html = viewer_client.get(device.node.get_absolute_url()).content.decode()
    assert "35 GB/s" in html and "9.5 GB/s" in html  # table, measured
    assert '9.5 GB/s <span class="muted">(measured)' in html  # what the planner uses
    assert "1.25 ms fixed cost of a pass" in html and "0.40 ms per RPC hop" in html
    assert "0.31 ms round trip to the RPC port" in html and "112 MB/s" in html
    assert "stale" not in html
    assert "calibrate-now" not in html and "override-figures" not in html  # viewers cannot


def test_an_old_measurement_is_marked_stale_but_still_used(viewer_client, settings):
    settings.RAMDECK_CALIBRATION_MAX_AGE_DAYS = 30
    device = calibrated_cpu(measured_at=timezone.now() - timedelta(days=31))
    assert device.measurement_state == "old" and device.effective_bandwidth_gbs == 9.5
    html = viewer_client.get(device.node.get_absolute_url()).content.decode()
    assert "stale: old" in html


def test_a_memory_limit_changes_what_fits_not_the_speed_so_the_figure_stays_fresh():
    device = calibrated_cpu()
    Device.objects.filter(pk=device.pk).update(total_bytes=512 * 2**20, free_bytes=400 * 2**20)
    assert Device.objects.get(pk=device.pk).measurement_state == "fresh"
    node = device.node
    node.facts = {**node.facts, "ram_physical_bytes": 64 * 2**30}  # other memory modules: other channels
    node.save()
    assert Device.objects.get(pk=device.pk).measurement_state == "hardware_changed"


def test_a_measurement_of_other_hardware_is_stale_and_the_table_is_used_again(viewer_client):
    device = calibrated_cpu()
    node = device.node
    node.facts = {**node.facts, "cpu_quota_cores": 0.25}  # the probe found a CPU quota since
    node.save()
    device = Device.objects.get(pk=device.pk)
    assert device.measurement_state == "hardware_changed"
    assert device.effective_bandwidth_gbs == 35.0 and device.bandwidth_source == "table"
    Device.objects.filter(pk=device.pk).update(description="AMD Ryzen 5 5600X")
    assert Device.objects.get(pk=device.pk).measurement_state == "hardware_changed"
    html = viewer_client.get(node.get_absolute_url()).content.decode()
    assert "stale: hardware changed" in html


def test_an_operator_calibrates_a_node_and_lands_on_the_job(
    operator_client, no_broker, django_capture_on_commit_callbacks
):
    device = calibrated_cpu()
    node = device.node
    Build.objects.create(node=node, source_kind="existing", rpc_server_path="/r", llama_server_path="/l")
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(reverse("calibration:node", args=[device.node.name]))
    job = Job.objects.get(kind="calibrate", node=device.node)
    assert response.status_code == 302 and response.url == job.get_absolute_url()
    assert no_broker == [job.pk]
    assert AuditEvent.objects.get(action="node.calibrate").changes == {"job": job.pk}
    operator_client.post(reverse("calibration:node", args=[device.node.name]))
    assert Job.objects.filter(kind="calibrate").count() == 1  # one at a time per node


def test_calibrate_all_starts_one_job_per_node_that_has_a_build_and_devices(
    operator_client, no_broker, django_capture_on_commit_callbacks
):
    ready = [calibrated_cpu(node_name=f"pc-{i}").node for i in range(2)]
    for node in ready:
        Build.objects.create(node=node, source_kind="existing", rpc_server_path="/r", llama_server_path="/l")
    NodeFactory(name="never-probed")
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(reverse("calibration:all"))
    assert response.status_code == 302
    jobs = Job.objects.filter(kind="calibrate")
    assert sorted(j.node.name for j in jobs) == ["pc-0", "pc-1"]
    assert sorted(no_broker) == sorted(j.pk for j in jobs)
    assert AuditEvent.objects.get(action="node.calibrate_all").changes == {"nodes": ["pc-0", "pc-1"]}


def test_viewers_cannot_calibrate(viewer_client):
    device = calibrated_cpu()
    assert viewer_client.post(reverse("calibration:node", args=[device.node.name])).status_code == 403
    assert viewer_client.post(reverse("calibration:all")).status_code == 403
    assert not Job.objects.exists()


def test_an_admin_overrides_a_figure_and_the_audit_history_records_it(admin_client):
    device = calibrated_cpu()
    url = reverse("calibration:figures", args=[device.node.name])
    page = admin_client.get(url).content.decode()
    assert "CPU (GB/s)" in page and "uses 9.5 GB/s (measured)" in page
    response = admin_client.post(url, {f"device_{device.pk}": "12.5"})
    assert response.status_code == 302
    device.refresh_from_db()
    assert device.bandwidth_override_gbs == 12.5 and device.effective_bandwidth_gbs == 12.5
    event = AuditEvent.objects.get(action="device.bandwidth_override")
    assert event.actor_name == "alice-admin" and event.changes == {"bandwidth_override_gbs": [None, 12.5]}
    assert event.object_id == str(device.pk)
    # Emptying the field goes back to the measurement, and is audited too.
    admin_client.post(url, {f"device_{device.pk}": ""})
    device.refresh_from_db()
    assert device.bandwidth_override_gbs is None and device.effective_bandwidth_gbs == 9.5
    assert AuditEvent.objects.filter(action="device.bandwidth_override").count() == 2


@pytest.mark.parametrize(
    ("value", "message"), [("-3", "greater than or equal to 0.01"), ("fast", "a number")]
)
def test_a_bad_override_is_refused_naming_the_problem(admin_client, value, message):
    device = calibrated_cpu()
    response = admin_client.post(
        reverse("calibration:figures", args=[device.node.name]), {f"device_{device.pk}": value}
    )
    assert response.status_code == 400 and message in response.content.decode()
    device.refresh_from_db()
    assert device.bandwidth_override_gbs is None
    assert not AuditEvent.objects.filter(action="device.bandwidth_override").exists()


@pytest.mark.parametrize("persona", ["viewer_client", "operator_client"])
def test_only_admins_may_override_figures(request, persona):
    client = request.getfixturevalue(persona)
    device = calibrated_cpu()
    url = reverse("calibration:figures", args=[device.node.name])
    assert client.get(url).status_code == 403
    assert client.post(url, {f"device_{device.pk}": "99"}).status_code == 403
    device.refresh_from_db()
    assert device.bandwidth_override_gbs is None
    assert AuditEvent.objects.filter(action="permission_denied").count() == 2
    assert not AuditEvent.objects.filter(action="device.bandwidth_override").exists()
