"""Step bodies of a deployment (deployments/steps/llama_server.py) against real local processes and a small
HTTP server standing in for llama-server's answers. The full path over SSH and real llama.cpp is
tests/deployments/test_e2e_deployment.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments.models import Deployment
from deployments.steps.checks import measure_body
from jobs.context import JobFailed
from jobs.on_node import without_key, write_secret_file
from llamacpp.reaper import runs_our_program
from remote.local import LocalTransport
from tests.deploy_fixtures import StepContext, step_deployment

pytestmark = pytest.mark.django_db(transaction=True)


def _serve(
    answer: dict | list[dict], *, asked: list | None = None, delay: float = 0.0
) -> ThreadingHTTPServer:
    """llama-server's /completion answers: `answer` every time, or the next of a list; the request bodies go
    to `asked`."""
    answers = list(answer) if isinstance(answer, list) else None

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            request = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if asked is not None:
                asked.append(json.loads(request))
            time.sleep(delay)
            if self.path == "/tokenize":
                # The measure step's long prompt, as token ids (llama-server's /tokenize answer).
                body = json.dumps({"tokens": list(range(1, 101))}).encode()
            else:
                # A list of answers is for the decode samples; the first token's requests get the last.
                reply = (
                    (answers.pop(0) if len(answers) > 1 else answers[0]) if answers is not None else answer
                )
                body = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            # /health and /metrics, as llama-server answers them.
            if self.path == "/metrics":
                body = b"llamacpp:tokens_predicted_total 1234\nllamacpp:requests_processing 1\n"
            else:
                body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_measure_without_timings_fails_with_a_readable_reason(local_node):
    server = _serve({"content": "once upon a time"})
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        ctx = StepContext({"deployment": deployment.pk}, node=local_node)
        with pytest.raises(JobFailed, match="without speed timings"):
            asyncio.run(measure_body(ctx))
    finally:
        server.shutdown()
        server.server_close()


def test_measure_records_the_speed_llama_server_reports(local_node):
    server = _serve({"timings": {"predicted_per_second": 12.5, "prompt_per_second": 80.0}})
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        result = asyncio.run(measure_body(StepContext({"deployment": deployment.pk}, node=local_node)))
    finally:
        server.shutdown()
        server.server_close()
    deployment.refresh_from_db()
    assert deployment.measured_decode_tps == 12.5 and "decode 12.5" in result
    assert deployment.predicted_decode_tps == 10.0 and deployment.speed_error == pytest.approx(0.25)
    # The first token after a long prompt, measured too (a plan made before issue 20 predicts none).
    check = deployment.first_word_check
    assert check["prompt_tokens"] > 16 and len(check["ttft_samples"]) == 2 and check["ttft_s"] >= 0
    assert check["ttft_predicted_s"] is None and not check["ttft_off"]


def test_a_measurement_far_from_the_prediction_names_the_node_to_calibrate_again(local_node):
    server = _serve({"timings": {"predicted_per_second": 4.0, "prompt_per_second": 80.0}})
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        ctx = StepContext({"deployment": deployment.pk}, node=local_node)
        asyncio.run(measure_body(ctx))
    finally:
        server.shutdown()
        server.server_close()
    deployment.refresh_from_db()
    assert deployment.speed_error == pytest.approx(-0.6) and deployment.speed_is_off
    decode = [line for line in ctx.lines if line.startswith(("decode ", "The prediction is off"))]
    assert "(-60% against the prediction)" in decode[-2]
    assert decode[-1] == (
        "The prediction is off by more than 25%. Likely: "
        "console-host: never calibrated: the plan used table figures for it"
    )


def _timings(tps: float, decoded: int = 128) -> dict:
    return {"timings": {"predicted_per_second": tps, "prompt_per_second": 80.0, "predicted_n": decoded,
                        "prompt_n": 20}}  # fmt: skip


EMPTY_AND_FULL = {
    "llama_server_args": [],
    "placements": [],
    "predicted_tokens_per_s": 10.0,
    "predicted_tokens_per_s_empty": 20.0,
    "kv_cells": 16384,
}


def test_measure_decodes_a_fixed_length_several_times_and_compares_at_the_context_it_filled(local_node):
    asked: list = []
    server = _serve([_timings(10.0), _timings(30.0), _timings(19.0)], asked=asked)
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        Deployment.objects.filter(pk=deployment.pk).update(plan=EMPTY_AND_FULL)
        ctx = StepContext({"deployment": deployment.pk}, node=local_node)
        asyncio.run(measure_body(ctx))
    finally:
        server.shutdown()
        server.server_close()
    decode, tokenize, first = asked[:3], asked[3], asked[4:]
    assert all(
        a["n_predict"] == 128 and a["ignore_eos"] is True and a["cache_prompt"] is False for a in decode
    )
    # Then the first token after a long prompt, sent as token ids of an exact length, twice.
    assert "content" in tokenize and len(first) == 2
    assert all(a["n_predict"] == 1 and a["cache_prompt"] is False and len(a["prompt"]) > 16 for a in first)
    deployment.refresh_from_db()
    assert deployment.measured_decode_tps == 19.0  # the median
    # Priced at its full 16384 cells the plan says 10 tok/s (+90%); at the 84 this run read, 19.8.
    assert deployment.predicted_decode_tps == pytest.approx(1 / (0.05 + 0.05 * 84 / 16384))
    assert not deployment.speed_is_off and deployment.speed_miss_reasons() == []
    check = deployment.verification["speed"]
    assert check["samples"] == [10.0, 30.0, 19.0] and check["filled"] == 84 and check["at_filled_context"]
    assert "the median of 3 runs of 128 tokens (10.0, 30.0, 19.0)" in ctx.lines[0]
    assert "at the 84 tokens of context it filled" in ctx.lines[0]
    assert ctx.lines[-1].startswith("first token after a prompt of ")


def test_a_run_that_decodes_fewer_tokens_than_asked_is_no_measurement(local_node):
    server = _serve(_timings(50.0, decoded=7))
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        ctx = StepContext({"deployment": deployment.pk}, node=local_node)
        with pytest.raises(JobFailed, match="decoded 7 tokens where 128 were asked for"):
            asyncio.run(measure_body(ctx))
    finally:
        server.shutdown()
        server.server_close()


def test_a_slow_measurement_while_the_coordinator_is_busy_names_the_load_not_only_a_calibration(local_node):
    burner = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    server = _serve(_timings(4.0), delay=0.7)
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        # The process measured is this test's own (the stand-in llama-server is a thread of it).
        deployment.add_process("llama-server@console-host", {"role": "llama-server", "pid": os.getpid()})

        async def measure():
            async with LocalTransport() as transport:
                ctx = StepContext({"deployment": deployment.pk}, node=local_node, transport=transport)
                await measure_body(ctx)
                return ctx

        ctx = asyncio.run(measure())
    finally:
        server.shutdown()
        server.server_close()
        burner.kill()
        burner.wait()
    deployment.refresh_from_db()
    use = deployment.verification["speed"]["cpu_use"]
    assert use["others_cpus"] >= 0.5, use  # the burner's core, at least half of it
    kinds = [row["kind"] for row in deployment.speed_miss_reasons()]
    assert kinds[0] == "load" and any("it was busy while it was measured" in line for line in ctx.lines)
    # Calibrating again is advised for the figures (never calibrated), not for the load.
    assert kinds == ["load", "calibration"] and deployment.recalibration_advice() == ["console-host"]


def test_processes_recorded_by_two_steps_are_both_kept(local_node):
    deployment = step_deployment(local_node)
    stale_copy = Deployment.objects.get(pk=deployment.pk)
    deployment.add_process("rpc-server@a", {"node": local_node.name, "role": "rpc-server", "pid": 1})
    stale_copy.add_process("llama-server@a", {"node": local_node.name, "role": "llama-server", "pid": 2})
    deployment.refresh_from_db()
    assert set(deployment.processes) == {"rpc-server@a", "llama-server@a"}
    assert stale_copy.processes == deployment.processes


def test_processes_are_grouped_by_their_node(local_node):
    from deployments.monitor import processes_by_node

    deployment = step_deployment(local_node)
    deployment.add_process("rpc-server@x", {"node": local_node.name, "role": "rpc-server", "pid": 1})
    deployment.add_process("gone@y", {"node": "deleted-node", "role": "rpc-server", "pid": 2})
    groups = processes_by_node(deployment)
    assert [(node.name, [p["pid"] for p in procs]) for node, procs in groups.items()] == [
        (local_node.name, [1])
    ]


# --------------------------------------------------------------------------------------------------
# The dashboard's one-click reap ends the PID it names, never whatever else holds the port
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def local_rpc_server(tmp_path):
    """A real ggml-rpc-server on the console host, started outside the console (a stale process)."""
    import subprocess
    import time

    from tests.deploy_fixtures import listeners_in, rpc_server_binary, stop_proc

    port = _free_port()
    argv = [str(rpc_server_binary()), "-H", "127.0.0.1", "-p", str(port)]
    with (tmp_path / "rpc.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    host = type("Host", (), {"exec_argv": staticmethod(lambda a: a)})()
    try:
        deadline = time.monotonic() + 30
        while f"pid={proc.pid}" not in listeners_in(host, port):
            assert time.monotonic() < deadline and proc.poll() is None, "rpc-server did not listen"
            time.sleep(0.2)
        yield proc, port
    finally:
        stop_proc(proc)


def _reap_job(node, port: int, pid: int):
    from jobs.models import Job
    from tests.deploy_fixtures import run

    return run(Job.objects.create(kind="reap", node=node, params={"ports": [port], "pid": pid}))


@pytest.mark.llamacpp
def test_the_reap_button_ends_the_stale_pid(local_node, local_rpc_server):
    from jobs.models import JobState

    proc, port = local_rpc_server
    job = _reap_job(local_node, port, proc.pid)
    assert job.state == JobState.SUCCEEDED, job.result
    proc.wait(timeout=10)
    assert f"reaped rpc-server PID {proc.pid}" in job.result


@pytest.mark.llamacpp
def test_the_reap_button_leaves_a_new_holder_of_the_port_alone(local_node, local_rpc_server):
    from jobs.models import JobState

    proc, port = local_rpc_server
    gone_pid = 4_000_000  # the PID the scan saw; it ended, and another process took the port since
    job = _reap_job(local_node, port, gone_pid)
    assert job.state == JobState.SUCCEEDED, job.result
    assert "no longer holds" in job.result
    assert proc.poll() is None


@pytest.mark.llamacpp
def test_the_reap_button_refuses_a_port_an_active_deployment_claims(local_node, local_rpc_server):
    from deployments.models import DeploymentState, ResourceClaim
    from jobs.models import JobState

    proc, port = local_rpc_server
    deployment = step_deployment(local_node, state=DeploymentState.LAUNCHING)
    ResourceClaim.objects.create(node=local_node, resource=f"port:{port}", deployment=deployment)
    job = _reap_job(local_node, port, proc.pid)
    assert job.state == JobState.FAILED and "claimed by deployment" in job.result
    assert proc.poll() is None


# --------------------------------------------------------------------------------------------------
# A PID reused by another program is neither killed by a stop nor taken for our server by the monitor
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def other_program():
    """A process that is not ours, standing on a PID a deployment once recorded."""
    import subprocess

    from tests.deploy_fixtures import stop_proc

    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield proc
    finally:
        stop_proc(proc)


def test_stop_does_not_kill_a_pid_that_now_runs_another_program(local_node, other_program):
    from jobs.models import Job, JobState
    from tests.deploy_fixtures import run

    info = {"node": local_node.name, "role": "rpc-server", "pid": other_program.pid, "port": _free_port()}
    job = run(Job.objects.create(kind="stop", node=local_node, params={"processes": [info]}))
    assert job.state == JobState.SUCCEEDED, job.result
    assert other_program.poll() is None
    assert "now runs another program" in "\n".join(job.log_lines.values_list("text", flat=True))


def test_the_monitor_does_not_take_a_reused_pid_for_our_server(local_node, other_program):
    from deployments.models import DeploymentState
    from deployments.monitor import check_deployment

    deployment = step_deployment(local_node, port=_free_port(), state=DeploymentState.RUNNING)
    deployment.add_process(
        "rpc-server@x",
        {"node": local_node.name, "role": "rpc-server", "pid": other_program.pid, "port": 1, "log": "/nope"},
    )
    reason = check_deployment(deployment)
    assert "now runs another program" in reason
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.DEGRADED


# --------------------------------------------------------------------------------------------------
# The monitor: one event loop for every deployment; what it saw is stored for the page
# --------------------------------------------------------------------------------------------------


def test_the_monitor_checks_every_deployment_in_one_event_loop(local_node, monkeypatch):
    from deployments import monitor
    from deployments.models import DeploymentState

    runs = []
    real = monitor.run_to_completion
    monkeypatch.setattr(monitor, "run_to_completion", lambda make: runs.append(1) or real(make))
    for port in (_free_port(), _free_port()):
        step_deployment(local_node, port=port, state=DeploymentState.RUNNING)
    assert len(monitor.check_all()) == 2  # nobody answers on those ports: both degraded
    assert runs == [1]


@pytest.mark.llamacpp
def test_the_monitor_stores_process_status_and_metrics_and_the_page_only_reads_them(
    local_node,
    local_rpc_server,
    monkeypatch,
    client,
):
    from django.urls import reverse

    from deployments import monitor
    from deployments.models import DeploymentState
    from tests.factories import UserFactory

    proc, rpc_port = local_rpc_server
    server = _serve({})
    try:
        deployment = step_deployment(local_node, port=server.server_address[1], state=DeploymentState.RUNNING)
        deployment.add_process(
            f"rpc-server@{local_node.name}",
            {"node": local_node.name, "role": "rpc-server", "pid": proc.pid, "port": rpc_port, "log": "/l"},
        )
        assert monitor.check_all() == []
    finally:
        server.shutdown()
        server.server_close()
    deployment.refresh_from_db()
    status = deployment.live_status
    (row,) = status["processes"]
    assert row["alive"] and row["pid"] == proc.pid and row["rss_bytes"] > 0 and row["uptime_s"] >= 0
    assert status["metrics"] == {"tokens_predicted_total": "1234", "requests_processing": "1"}

    def no_remote_calls(*args, **kwargs):
        raise AssertionError("the page must not reach a node")

    monkeypatch.setattr("jobs.aio.open_transport", no_remote_calls)
    monkeypatch.setattr(monitor, "transport_for", no_remote_calls)
    monkeypatch.setattr("httpx.get", no_remote_calls)
    client.force_login(UserFactory(username="vera", role="viewer"))
    page = client.get(reverse("deployments:processes", args=[deployment.pk])).content.decode()
    assert str(proc.pid) in page and "As of" in page
    # The /metrics numbers in words, not their Prometheus names.
    assert "Since it started it has written 1,234 tokens." in page
    assert "It is answering 1 request right now." in page and "tokens_predicted_total" not in page


def test_a_pid_check_never_returns_an_api_key_from_the_command_line():
    """A PID reused by a program that carries a key on its command line: the check says 'not ours' and
    the command line it hands back (for the log and the audit) has the key hidden."""
    import subprocess
    import sys

    from remote.local import LocalTransport

    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "--api-key", "sekrit-key-123"]
    )
    try:

        async def check():
            async with LocalTransport() as transport:
                return await runs_our_program(transport, "linux", process.pid, "rpc-server")

        ours, cmdline = asyncio.run(check())
    finally:
        process.kill()
        process.wait()
    assert ours is False
    assert "--api-key" in cmdline and "sekrit-key-123" not in cmdline


def test_llama_server_log_lines_never_show_the_key():
    line = "main: api_keys: ****abcd, server is listening on http://127.0.0.1:8080"
    assert "abcd" not in without_key(line)


@pytest.mark.security
def test_a_key_file_is_written_from_memory_0600_and_nothing_passes_through_the_consoles_tempdir(
    local_node, tmp_path, monkeypatch
):
    import os
    import tempfile

    from remote.local import LocalTransport

    console_tmp = tmp_path / "console-tmp"
    console_tmp.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(console_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(console_tmp))
    # What the folder holds while the key is on its way (the old way left nothing behind either: its
    # temporary copy was deleted after the upload).
    during = []
    for name in ("upload", "write_file"):
        original = getattr(LocalTransport, name)

        async def watched(self, *args, _original=original, **kwargs):
            during.append(sorted(p.name for p in console_tmp.iterdir()))
            return await _original(self, *args, **kwargs)

        monkeypatch.setattr(LocalTransport, name, watched)
    path = tmp_path / "d7-llama-server-8080.key"
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    previous = os.umask(0)
    try:
        asyncio.run(write_secret_file(ctx, str(path), "the-api-key"))
    finally:
        os.umask(previous)
    assert path.read_text() == "the-api-key\n" and oct(path.stat().st_mode & 0o777) == "0o600"
    assert during == [[]] and list(console_tmp.iterdir()) == []
    assert ctx.lines == []  # not a word of it in the job log


LOAD_LINES = [
    "load_tensors: offloaded 5/5 layers to GPU",
    "load_tensors:          CPU model buffer size =     1.94 MiB",
    "llama_kv_cache:        CPU KV buffer size =     2.00 MiB",
]


def test_verify_waits_for_the_load_report_that_llama_servers_log_thread_writes_late(tmp_path):
    from deployments.steps.checks import read_load_report
    from remote.local import LocalTransport

    log = tmp_path / "llama-server.log"
    log.write_text("main: loading model\n")  # /health answers before the load's lines reach the file

    async def scenario():
        async def catch_up():
            await asyncio.sleep(1.5)
            with log.open("a") as handle:
                handle.write("\n".join(LOAD_LINES) + "\nmain: server is listening\n")

        async with LocalTransport(command_timeout=30) as transport:
            late = asyncio.create_task(catch_up())
            started = asyncio.get_running_loop().time()
            text = await read_load_report(transport, str(log), wait=20)
            waited = asyncio.get_running_loop().time() - started
            await late
            # A log that never holds them is read again until the wait is over, then taken as it is.
            missing = tmp_path / "quiet.log"
            missing.write_text("main: server is listening\n")
            started = asyncio.get_running_loop().time()
            quiet = await read_load_report(transport, str(missing), wait=1.0)
            gave_up = asyncio.get_running_loop().time() - started
        return text, waited, quiet, gave_up

    text, waited, quiet, gave_up = asyncio.run(scenario())
    assert text.splitlines() == LOAD_LINES
    assert 1.5 <= waited < 10
    assert quiet == "" and 1.0 <= gave_up < 5


def test_the_page_says_the_prediction_was_taken_at_the_context_the_measurement_filled(
    local_node, admin_client
):
    deployment = step_deployment(local_node)
    speed = {"filled": 84.0, "at_filled_context": True, "predicted_full": 10.0, "samples": [19.0]}
    deployment.record(measured_decode_tps=19.0, predicted_decode_tps=19.8, verification={"speed": speed})
    page = admin_client.get(deployment.get_absolute_url()).content.decode()
    assert (
        "Measured 19.0 tok/s against 19.8 predicted at the 84 tokens of context the measurement filled"
        in page
    )
    assert "(the plan's full context: 10.0)" in page and "Prediction held" in page
