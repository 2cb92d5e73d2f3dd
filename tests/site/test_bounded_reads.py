"""Every read from a node is bounded (issue 17): a command job that prints far more than the console keeps,
and a stand-in llama-server that answers the chat and the measure step with far more than they read. Each
says what it cut, and the console's memory stays small (tracemalloc's peak while it reads).

The transports' own bounds (line length, bytes kept per command) are tested in
tests/remote/test_local_transport.py and tests/remote/test_ssh_transport.py against a real process and a
real sshd.
"""

# ruff: noqa: F811 - fixtures are imported from tests/job_fixtures.py and used as parameters
from __future__ import annotations

import asyncio
import json
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments.models import DeploymentState
from deployments.steps.checks import measure_body
from jobs.context import JobFailed
from jobs.models import JobLogLine, JobState
from jobs.runner import run_job
from remote import bounded_http
from tests.chat_fixtures import chat_deployment, chat_events, post_chat
from tests.deploy_fixtures import StepContext, step_deployment
from tests.job_fixtures import channel_layer, local_node, make_command_job  # noqa: F401 - fixtures

pytestmark = [pytest.mark.security, pytest.mark.timeout(180), pytest.mark.django_db(transaction=True)]

MIB = 2**20
# What the stand-in sends: far more than any bound, in pieces, for as long as the reader reads.
FLOOD_BYTES = 64 * MIB


def _flooding_server(
    status: int, head: bytes, piece: bytes, total: int = FLOOD_BYTES
) -> tuple[ThreadingHTTPServer, dict]:
    """Answers every POST with `status`, `head`, then `piece` repeated up to `total` bytes (no
    Content-Length, the connection closed at the end); `sent` counts what the reader took."""
    sent = {"bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                self.wfile.write(head)
                while sent["bytes"] < total:
                    self.wfile.write(piece)
                    sent["bytes"] += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the console stopped reading: as it should

        def log_message(self, *args):
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, sent


def _peak(run):
    tracemalloc.start()
    try:
        result = run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def test_a_command_job_that_prints_without_end_keeps_its_budget_and_says_so(
    local_node, channel_layer, settings
):
    settings.RAMDECK_COMMAND_OUTPUT_MAX_BYTES = 256 * 1024
    script = (
        "yes 'a line of output' | head -n 500000; head -c 1000000 /dev/zero | tr '\\0' x; echo; echo the-end"
    )
    job = make_command_job(local_node, ["sh", "-c", script])
    _, peak = _peak(lambda: run_job(job.pk))
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.result
    texts = list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True))
    (note,) = [text for text in texts if text.startswith("[output truncated after ")]
    assert "RAMDECK_COMMAND_OUTPUT_MAX_BYTES" in note and "its last 20 lines:" in note
    # How it ended is kept, after the note: its last lines (the longest cut), then the runner's own line.
    after = texts[texts.index(note) + 1 :]
    assert len(after) == 21 and after[-1].startswith("Succeeded")
    assert after[-3].startswith("x" * 1000) and after[-3].endswith("more characters cut]")
    assert after[-2] == "the-end"
    stored = sum(len(text) for text in texts)
    assert stored < 256 * 1024 + 40_000, stored  # the budget, the note, and the (cut) last lines
    assert peak < 48 * MIB, f"peak {peak / MIB:.1f} MiB"
    print(f"\nOUTPUT-BOUND job 9.5 MB printed, {len(texts)} lines stored, peak {peak / MIB:.1f} MiB")


def test_the_chat_reads_the_first_bytes_of_an_endless_error_and_never_a_whole_endless_line(
    local_node, operator_user
):
    message = [{"role": "user", "content": "hi"}]
    server, sent = _flooding_server(500, b'{"error": {"message": "out of memory ', b"x" * 65536)
    try:
        deployment = chat_deployment(local_node, server.server_address[1])
        response, peak = _peak(lambda: post_chat(operator_user, deployment, message))
    finally:
        server.shutdown()
        server.server_close()
    assert response.status_code == 502
    reason = response.json()["error"]
    assert reason.startswith('llama-server answered 500: {"error": {"message": "out of memory xxx')
    assert len(reason) < 1000
    assert sent["bytes"] < FLOOD_BYTES and peak < 16 * MIB, (sent, peak)

    server, sent = _flooding_server(200, b'data: {"choices": [{"delta": {"content": "', b"y" * 65536)
    try:
        deployment.port = server.server_address[1]
        deployment.save(update_fields=["port"])
        response, peak = _peak(lambda: post_chat(operator_user, deployment, message))
    finally:
        server.shutdown()
        server.server_close()
    assert response.status_code == 200
    events = chat_events(response)
    limit = bounded_http.MAX_LINE_BYTES
    assert events == [
        {"error": f"llama-server sent a line longer than {limit} bytes; the answer stops here."}
    ]
    assert sent["bytes"] < FLOOD_BYTES and peak < 16 * MIB, (sent, peak)
    assert deployment.state == DeploymentState.RUNNING
    print(f"\nOUTPUT-BOUND chat: line cut, {sent['bytes'] / MIB:.1f} MiB sent, peak {peak / MIB:.1f} MiB")


def test_the_measure_step_reads_at_most_a_mebibyte_of_answer(local_node):
    server, sent = _flooding_server(200, b'{"content": "', b"z" * 65536)
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        ctx = StepContext({"deployment": deployment.pk}, node=local_node)

        def measure():
            with pytest.raises(JobFailed) as failed:
                asyncio.run(measure_body(ctx))
            return failed.value

        failure, peak = _peak(measure)
    finally:
        server.shutdown()
        server.server_close()
    assert str(failure) == (
        f"llama-server's /completion answer is larger than {bounded_http.MAX_ANSWER_BYTES} bytes; not read "
        "further; cannot measure"
    )
    assert sent["bytes"] < FLOOD_BYTES and peak < 16 * MIB, (sent, peak)


def test_a_measure_answer_that_is_not_a_json_object_is_a_readable_failure(local_node):
    server, _ = _flooding_server(200, json.dumps(["timings"]).encode(), b"", total=0)
    try:
        deployment = step_deployment(local_node, port=server.server_address[1])
        with pytest.raises(JobFailed, match="not a JSON object"):
            asyncio.run(measure_body(StepContext({"deployment": deployment.pk}, node=local_node)))
    finally:
        server.shutdown()
        server.server_close()
