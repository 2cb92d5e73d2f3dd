"""Speed samples from a real llama-server's /metrics: the counters the dashboard's sparkline is drawn from
exist under the names the monitor reads, and their differences give the decode speed llama-server itself
reports for the completion in between."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from deployments.models import Deployment, DeploymentState, SpeedSample
from deployments.monitor import parse_metrics
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from ramdeck_site.services import free_port
from tests.factories import NodeFactory
from tests.llamacpp_build import require_llamacpp

pytestmark = [pytest.mark.llamacpp, pytest.mark.django_db]


@pytest.fixture
def llama_server(tmp_path):
    binaries = require_llamacpp()
    model = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama())
    port = free_port()
    argv = [str(binaries.llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", "512", "--metrics", "-t", "1"]  # fmt: skip
    with open(tmp_path / "server.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            time.sleep(0.2)
        else:
            pytest.fail("llama-server did not become healthy in 120 s")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def look(url: str) -> dict[str, str]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def test_samples_follow_the_decode_speed_llama_server_reports(llama_server):
    node = NodeFactory(name="desk", address="127.0.0.1", transport="local")
    model = ModelFile.objects.create(name="tiny", node=node, path="/tiny.gguf", profile={})
    deployment = Deployment.objects.create(name="tiny", model_file=model, coordinator=node, plan={},
                                           state=DeploymentState.RUNNING)  # fmt: skip
    before = SpeedSample.record(deployment, look(llama_server))
    assert before is not None and before.tokens_total == 0 and before.tokens_per_s is None

    answer = httpx.post(f"{llama_server}/completion", json={"prompt": "Hello", "n_predict": 32,
                        "ignore_eos": True}, timeout=120).json()  # fmt: skip
    after = SpeedSample.record(deployment, look(llama_server))
    assert after.tokens_total - before.tokens_total == answer["tokens_predicted"]
    reported = answer["timings"]["predicted_per_second"]
    assert after.tokens_per_s == pytest.approx(reported, rel=0.1), (after.tokens_per_s, reported)

    idle = SpeedSample.record(deployment, look(llama_server))
    assert idle.tokens_per_s is None  # nothing generated since: a gap in the sparkline, not a zero
