"""The calibration's pure parts: the line through two runs, and when a node is not calibrated."""

from __future__ import annotations

import pytest

from deployments.calibrate_job import Run, _refusal, fit
from deployments.models import Deployment, DeploymentState, ModelFile, ResourceClaim
from nodes.models import Build
from tests.factories import DeviceFactory, NodeFactory

MB = 1_000_000


def test_two_depths_give_the_bandwidth_as_slope_and_the_fixed_cost_as_intercept():
    # 2 ms fixed + bytes at 10 GB/s: 40 MB -> 6 ms, 120 MB -> 14 ms.
    line = fit(Run("shallow", 40 * MB, [150.0, 1000 / 6, 180.0]), Run("deep", 120 * MB, [1000 / 14]))
    assert line.bandwidth_bps == pytest.approx(10e9)
    assert line.fixed_s == pytest.approx(0.002)


def test_the_median_sample_counts_so_one_disturbed_sample_does_not_move_it():
    assert Run("shallow", 40 * MB, [20.0, 250.0, 200.0]).seconds_per_token == pytest.approx(0.005)


def test_runs_that_cannot_be_told_apart_claim_no_bandwidth():
    line = fit(Run("shallow", 40 * MB, [200.0]), Run("deep", 120 * MB, [198.0]))
    assert line.bandwidth_bps is None and line.fixed_s == pytest.approx(0.005)


def test_a_line_that_leaves_most_of_the_time_to_fixed_cost_is_not_trusted():
    # 23 ms and 25 ms for 46 and 136 MB: "45 GB/s and 22 ms fixed" is noise, not a measurement.
    line = fit(Run("shallow", 46 * MB, [1000 / 23]), Run("deep", 136 * MB, [1000 / 25]))
    assert line.bandwidth_bps is None and line.fixed_s == pytest.approx(0.023)


@pytest.mark.django_db
def test_a_node_is_calibrated_only_with_a_build_devices_and_no_running_deployment():
    node = NodeFactory(name="desk")
    assert "no llama.cpp build" in _refusal(node)
    Build.objects.create(node=node, source_kind="existing", rpc_server_path="/r", llama_server_path="/l")
    assert "probe it first" in _refusal(node)
    DeviceFactory(node=node)
    assert _refusal(node) == ""
    model = ModelFile.objects.create(name="m", node=node, path="/m.gguf", profile={})
    deployment = Deployment.objects.create(
        name="chat", model_file=model, coordinator=node, plan={}, state=DeploymentState.RUNNING
    )
    ResourceClaim.objects.create(node=node, resource="port:50052", deployment=deployment)
    assert "serves deployment chat" in _refusal(node) and "Stop the deployment first" in _refusal(node)
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPED)
    assert _refusal(node) == ""
