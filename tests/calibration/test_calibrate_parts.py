"""The calibration's pure parts: the line through two runs, the CPU-time split under a quota, and when a node
is not calibrated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from asgiref.sync import async_to_sync

from builds.models import Build
from calibration.fit import CalibrationModel, Run, comparable, cpu_ticks, fit, rpc_share
from calibration.job import upload_models
from calibration.store import refusal as _refusal
from calibration.store import start_calibration
from deployments.models import Deployment, DeploymentState, ResourceClaim
from jobs.models import Job
from modelfiles.models import ModelFile
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


# Two /proc/PID/stat lines as Linux writes them (utime and stime are the 14th and 15th fields); the second
# process's name holds a space and a parenthesis, which must not shift the fields.
STAT = (
    "4242 (llama-server) S 1 4242 4242 0 -1 4194560 9000 0 0 0 130 20 0 0 20 0 3 0 777 1 1\n"
    "4243 (rpc (server) x) S 1 4243 4243 0 -1 4194560 9000 0 0 0 300 50 0 0 20 0 3 0 778 1 1\n"
)


def test_cpu_ticks_are_user_plus_system_time_by_pid_whatever_the_process_is_called():
    assert cpu_ticks(STAT) == {4242: 150, 4243: 350}
    assert cpu_ticks("") == {} and cpu_ticks("garbage\n") == {}


def test_the_rpc_servers_share_is_theirs_of_the_ticks_spent_between_two_readings():
    before = {1: 100, 2: 1000, 3: 50}
    after = {1: 130, 2: 1050, 3: 70}  # llama-server (1) 30 ticks, rpc-servers (2, 3) 50 + 20
    assert rpc_share(before, after, llama_pid=1) == pytest.approx(0.7)
    assert rpc_share(None, after, llama_pid=1) is None
    # Too few ticks to split, readings of other processes, a PID reused in between: nothing is claimed.
    assert rpc_share({1: 0, 2: 0}, {1: 5, 2: 10}, llama_pid=1) is None
    assert rpc_share({1: 100, 2: 1000}, after, llama_pid=1) is None
    assert rpc_share(before, after, llama_pid=9) is None
    assert rpc_share(before, {1: 130, 2: 10, 3: 70}, llama_pid=1) is None


def test_under_a_quota_only_the_rpc_servers_share_of_a_run_counts_for_the_device():
    # 60 % of each run's CPU time was the rpc-server's: in a deployment, without llama-server beside it on
    # the node, it takes 60 % of the time. 10 and 30 ms measured -> 6 and 18 ms: 80 MB in 12 ms.
    shallow = Run("shallow", 40 * MB, [100.0], rpc_cpu_share=0.6)
    deep = Run("deep", 120 * MB, [1000 / 30], rpc_cpu_share=0.6)
    assert shallow.seconds_per_token == pytest.approx(0.010)
    assert shallow.device_seconds_per_token == pytest.approx(0.006)
    line = fit(shallow, deep)
    assert line.bandwidth_bps == pytest.approx(80 * MB / 0.012)
    assert line.fixed_s == pytest.approx(0.0)
    # No share read (no quota): the wall time is the device's.
    assert Run("shallow", 40 * MB, [100.0]).device_seconds_per_token == pytest.approx(0.010)


def test_a_run_without_a_share_puts_both_runs_of_the_line_on_wall_time():
    # The deep run's share could not be read: a slope between a scaled and an unscaled time would mean
    # nothing, so both count as measured (the line of the first test, 10 GB/s and 2 ms).
    shallow = Run("shallow", 40 * MB, [1000 / 6], rpc_cpu_share=0.5)
    deep = Run("deep", 120 * MB, [1000 / 14])
    assert comparable(shallow, deep) == pytest.approx([0.006, 0.014])
    line = fit(shallow, deep)
    assert line.bandwidth_bps == pytest.approx(10e9) and line.fixed_s == pytest.approx(0.002)


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
    assert _refusal(node, besides=deployment) == ""  # the one that stops first does not count
    # Never a job sure to fail: nothing is queued while the deployment holds the node.
    assert start_calibration(node) is None and not Job.objects.filter(kind="calibrate").exists()
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPED)
    assert _refusal(node) == ""
    assert start_calibration(node) is not None
    assert start_calibration(node) is None  # one at a time per node
    assert Job.objects.filter(kind="calibrate").count() == 1


def test_a_prompt_run_gives_the_devices_prompt_throughput_in_flops_per_second():
    from calibration.fit import CalibrationModel, prompt_gflops

    # 100 MFLOP a token of matrices, 1 kFLOP a token per position of attention, 2 MFLOP of output layer: a
    # 400-token prompt is 40 GFLOP + 80.2 MFLOP + 2 MFLOP; at 400 tokens/s (the median) that takes 1 s.
    model = CalibrationModel("deep", "", "", 0, 0, matrix_flops=100e6, attention_flops=1e3, output_flops=2e6)
    run = Run("deep", 0, [10.0], prompt_tokens=400, prompt_per_s=[300.0, 400.0, 500.0])
    assert prompt_gflops(model, run) == pytest.approx((40e9 + 1e3 * 400 * 401 / 2 + 2e6) / 1e9, abs=0.01)
    assert prompt_gflops(model, Run("deep", 0, [10.0])) is None


def test_calibration_stores_the_prompt_throughput_and_says_it(db, viewer_client):
    from django.urls import reverse

    from calibration.store import store

    node = NodeFactory(name="box")
    device = DeviceFactory(node=node, name="CPU", kind="cpu")
    figures = {
        "bandwidth_gbs": 12.0,
        "overhead_ms": 0.2,
        "prompt_gflops": 61.5,
        "prompt_tokens_per_s": [90, 95],
    }
    lines = store(node, {"devices": {"CPU": figures}, "link": {"rtt_ms": 0.3, "throughput_mbs": 95.0}})
    device.refresh_from_db()
    assert device.measured_prompt_gflops == 61.5
    assert "CPU: prompts 62 GFLOP/s (95 tokens/s of the calibration model)" in lines
    assert any("95.0 MB/s" in line for line in lines)
    # The node page's calibration figures show it beside the device's bandwidth.
    page = viewer_client.get(reverse("nodes:detail", args=[node.name])).content.decode()
    assert '<span class="muted prompt-throughput">prompts 62 GFLOP/s</span>' in page


class _Recorded:
    """A job context that records the commands and uploads the calibration sends a node, whose files are
    of the sizes in `present`."""

    def __init__(self, present: dict[str, int]):
        self.present = present
        self.commands: list[list[str]] = []
        self.transport = self

    async def run(self, argv, **kwargs):
        self.commands.append(list(argv))
        if argv[:2] == ["sh", "-c"]:  # the size of a file on the node
            size = self.present.get(argv[-1])
            return SimpleNamespace(stdout="" if size is None else str(size), exit_status=0 if size else 1)
        return SimpleNamespace(stdout="", exit_status=0)

    async def upload(self, local, remote):
        self.commands.append(["upload", local, remote])

    async def log(self, text):
        pass


def _models():
    return [
        CalibrationModel("shallow", "/cache/s.gguf", "s.gguf", 100 * MB, 100 * MB),
        CalibrationModel("deep", "/cache/d.gguf", "d.gguf", 300 * MB, 300 * MB),
    ]


def test_new_models_are_written_out_to_disk_before_anything_is_measured():
    ctx = _Recorded({"/home/x/calibrate/s.gguf": 100 * MB})  # the shallow one is there from before
    paths = async_to_sync(upload_models)(ctx, _models(), "/home/x/calibrate")
    assert paths == {"shallow": "/home/x/calibrate/s.gguf", "deep": "/home/x/calibrate/d.gguf"}
    uploads = [c for c in ctx.commands if c[0] == "upload"]
    assert [c[1] for c in uploads] == ["/cache/d.gguf"]
    # Once, after the last rename: the kernel's writeback of 300 MB would run during the measurement.
    assert ctx.commands[-1] == ["sync"] and ctx.commands.count(["sync"]) == 1
    assert ctx.commands[-2][:3] == ["mv", "-f", uploads[0][2]]


def test_models_already_on_the_node_are_not_synced_again():
    present = {"/home/x/calibrate/s.gguf": 100 * MB, "/home/x/calibrate/d.gguf": 300 * MB}
    ctx = _Recorded(present)
    async_to_sync(upload_models)(ctx, _models(), "/home/x/calibrate")
    assert ["sync"] not in ctx.commands and not any(c[0] == "upload" for c in ctx.commands)
