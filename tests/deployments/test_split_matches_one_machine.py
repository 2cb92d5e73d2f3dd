"""A split computes what one machine computes: the real model (SmolLM2-135M-Instruct) deployed by the
console over the coordinator and two lab workers (real sshd, real ggml-rpc-servers in their namespaces)
answers a fixed question with greedy sampling token for token as llama-server alone on this machine does.

Upstream has shipped RPC bugs that produce wrong output while every process looks healthy; a generated model
with random weights cannot show them, a real model's greedy tokens do. No tolerance: the RPC workers run the
same CPU kernels on the same weights, and greedy decoding (temperature 0, a fixed seed) picks the top token,
so the 64 tokens must be identical. Both sides use the same context, batch sizes and flash-attention setting
(the split's, as llama.cpp logged it)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from llamacpp.gguf import profile_path
from modelfiles.models import ModelFile
from nodes.models import Device, DeviceKind
from planning import planner
from ramdeck_site.services import free_port
from tests.deploy_fixtures import (
    LLAMA_PORT,
    planner_nodes_of,
    ready_node,
    record_enqueued,
    route_between,
)
from tests.factories import UserFactory
from tests.llamacpp_build import require_llamacpp
from tests.real_model import require_real_model
from tests.runs import run_deployment, run_stop

pytestmark = [
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.timeout(900),
    pytest.mark.django_db(transaction=True),
]

MIB = 2**20
CTX = 512
N_PREDICT = 64
SEED = 1234
PROMPT = (
    "<|im_start|>user\nWhat is the capital of France? Answer in two sentences.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def ask(url: str, key: str | None = None) -> list[int]:
    """The 64 tokens llama-server decodes greedily for the fixed prompt."""
    body = {
        "prompt": PROMPT,
        "n_predict": N_PREDICT,
        "temperature": 0,
        "seed": SEED,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(f"{url}/completion", json=body, headers=headers, timeout=600)
    assert answer.status_code == 200, answer.text[:2000]
    tokens = answer.json()["tokens"]
    assert len(tokens) == N_PREDICT, answer.json()
    return tokens


def detokenize(url: str, tokens: list[int], key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/detokenize", json={"tokens": tokens}, headers=headers, timeout=60).json()[
        "content"
    ]


def flash_attention_of(log: str) -> str:
    """on or off, as llama.cpp resolved it for the split (its `-fa auto` decides per device)."""
    match = re.search(r"Flash Attention was auto, set to (enabled|disabled)", log)
    if match:
        return "on" if match[1] == "enabled" else "off"
    match = re.search(r"flash_attn\s*=\s*(\w+)", log)
    return {"enabled": "on", "disabled": "off"}.get(match[1], match[1]) if match else "auto"


def one_machine(binaries, gguf, plan: dict, fa: str, log_path) -> tuple[list[int], str]:
    """llama-server alone on this machine (every layer on its CPU), with the split's context and batch."""
    port = free_port()
    args = plan["llama_server_args"]
    argv = [str(binaries.llama_server), "-m", str(gguf), "--device", "none", "-ngl", "0"]
    argv += ["-c", args[args.index("-c") + 1], "-np", args[args.index("-np") + 1], "-fa", fa]
    # No busy polling: on a machine whose cores are taken its threads would wait for each other (no effect
    # on the numbers computed).
    argv += ["--poll", "0", "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.25)
        tokens = ask(url)
        return tokens, detokenize(url, tokens)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def small_workers(coordinator, workers) -> None:
    """A slow coordinator with room for everything and two fast workers with room for part of the model
    each, so the plan puts blocks on all three (the lab hosts really share this machine's RAM)."""
    Device.objects.filter(node__in=[coordinator, *workers]).delete()
    Device.objects.create(node=coordinator, name="CPU", kind=DeviceKind.CPU, total_bytes=24000 * MIB,
                          free_bytes=24000 * MIB, bandwidth_gbs=2.0)  # fmt: skip
    for worker, mib in zip(workers, (40, 72), strict=True):
        Device.objects.create(node=worker, name="CPU", kind=DeviceKind.CPU, total_bytes=mib * MIB,
                              free_bytes=mib * MIB, bandwidth_gbs=40.0)  # fmt: skip


def test_the_real_model_split_over_two_workers_answers_token_for_token_as_one_machine(
    lab, lab_hosts, tmp_path, monkeypatch
):
    binaries = require_llamacpp()
    gguf = require_real_model()
    hosts = lab_hosts(3)
    route_between(hosts)
    operator = UserFactory(username="oscar-operator", role="operator")
    coordinator = ready_node(lab, hosts[0], "desk", may_coordinate=True)
    workers = [ready_node(lab, host, f"old-pc-{i}") for i, host in enumerate(hosts[1:], start=1)]
    small_workers(coordinator, workers)
    profile = profile_path(gguf)
    # The lab hosts share this file system: the coordinator reads the model from the cache.
    model = ModelFile.objects.create(
        name="SmolLM2", node=coordinator, path=str(gguf), size_bytes=profile["size_bytes"], profile=profile
    )
    plan = planner.plan(profile, planner_nodes_of(coordinator, workers), planner.Settings(ctx=CTX))
    assert plan["fits"], plan
    holders = {p["node"] for p in plan["placements"] if p["layers"] > 0}
    assert holders == {"desk", "old-pc-1", "old-pc-2"}, plan["placements"]
    deployment = Deployment.objects.create(
        name="SmolLM2 split", model_file=model, coordinator=coordinator, plan=plan,
        plan_settings=plan["settings"], port=LLAMA_PORT, created_by=operator,
    )  # fmt: skip
    record_enqueued(monkeypatch)
    started, message = lifecycle.start_deploy(deployment, operator)
    assert started, message
    try:
        run_deployment(deployment.pk)
        deployment.refresh_from_db()
        assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
        assert deployment.verification["problems"] == [], deployment.verification
        url, key = f"http://{coordinator.address}:{LLAMA_PORT}", deployment.api_key()
        split_tokens = ask(url, key)
        split_text = detokenize(url, split_tokens, key)
        # The lab hosts share this file system: llama-server's log is readable here.
        server = next(p for p in deployment.processes.values() if p["role"] == "llama-server")
        fa = flash_attention_of(Path(server["log"]).read_text(errors="replace"))
    finally:
        record_enqueued(monkeypatch)
        stopped, _ = lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk), operator)
        if stopped:
            run_stop(deployment.pk)
    single_tokens, single_text = one_machine(binaries, gguf, plan, fa, tmp_path / "single.log")
    print(f"\nsplit ({', '.join(sorted(holders))}, fa {fa}): {split_text!r}\none machine: {single_text!r}")
    assert split_tokens == single_tokens, (split_text, single_text)
    assert "Paris" in single_text
