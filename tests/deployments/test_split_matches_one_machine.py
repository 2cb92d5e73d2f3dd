"""A split computes what one machine computes: the real model (SmolLM2-135M-Instruct) deployed by the
console over the coordinator and two lab workers (real sshd, real ggml-rpc-servers in their namespaces)
answers a fixed question with greedy sampling token for token as llama-server alone on this machine does.

Upstream has shipped RPC bugs that produce wrong output while every process looks healthy; a generated model
with random weights cannot show them, a real model's greedy tokens do. No tolerance: the RPC workers run the
same CPU kernels on the same weights, and greedy decoding (temperature 0, a fixed seed) picks the top token,
so the 64 tokens must be identical. Both sides use the same context, batch sizes and flash-attention setting
(the split's, as llama.cpp logged it).

The same check runs on a generated mixture of experts (random weights, llama.cpp's `llama` architecture with
eight experts, two per token) planned with its experts apart from their attention: every block on one
worker, the experts of some blocks on the other worker and of others on the coordinator's CPU (`-ot`
rules), so a token's feed-forward crosses the RPC link twice per such block. No tolerance there either,
with one machine's llama-server at `--no-repack`: on a CPU with AMX (this machine's) llama.cpp otherwise
copies the attention's f16 matrices into AMX tiles and multiplies them with other kernels than the
rpc-servers' plain CPU backend (which never repacks), and random weights make near-ties between the top two
logits that the different rounding then breaks differently (seen here: the first difference at token 20).
With the same kernels on the same bytes (an activation sent over RPC is copied, not rounded) a near-tie
breaks the same way on both. The test prints the smallest top-1/top-2 log-probability gap one machine saw.
The real model's check keeps llama.cpp's defaults on both sides."""

from __future__ import annotations

import contextlib
import math
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from llamacpp.gguf import profile_path
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
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


def ask(url: str, key: str | None = None, prompt: str = PROMPT, probs: list | None = None) -> list[int]:
    """The 64 tokens llama-server decodes greedily for the fixed prompt; with `probs`, the top two
    candidates' probabilities at every position are appended to it."""
    body = {
        "prompt": prompt,
        "n_predict": N_PREDICT,
        "temperature": 0,
        "seed": SEED,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        **({"n_probs": 2} if probs is not None else {}),
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(f"{url}/completion", json=body, headers=headers, timeout=600)
    assert answer.status_code == 200, answer.text[:2000]
    tokens = answer.json()["tokens"]
    assert len(tokens) == N_PREDICT, answer.json()
    if probs is not None:
        for position in answer.json().get("completion_probabilities", []):
            top = position.get("top_logprobs") or position.get("top_probs") or []
            probs.append([c["logprob"] if "logprob" in c else math.log(c["prob"]) for c in top[:2]])
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


def one_machine(
    binaries,
    gguf,
    plan: dict,
    fa: str,
    log_path,
    prompt: str = PROMPT,
    probs: list | None = None,
    extra: tuple[str, ...] = (),
) -> tuple[list[int], str]:
    """llama-server alone on this machine (every layer on its CPU), with the split's context and batch."""
    port = free_port()
    args = plan["llama_server_args"]
    argv = [str(binaries.llama_server), "-m", str(gguf), "--device", "none", "-ngl", "0"]
    argv += ["-c", args[args.index("-c") + 1], "-np", args[args.index("-np") + 1], "-fa", fa]
    # No busy polling: on a machine whose cores are taken its threads would wait for each other (no effect
    # on the numbers computed).
    argv += ["--poll", "0", *extra, "--host", "127.0.0.1", "--port", str(port)]
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
        tokens = ask(url, prompt=prompt, probs=probs)
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


# ---------------------------------------------------------------------------------------------------------
# A generated mixture of experts, its experts apart from their attention

MOE = TinyLlama(n_layer=6, n_embd=256, n_head=8, n_head_kv=2, n_ff=512, n_expert=8, n_expert_used=2, seed=19)
MOE_PROMPT = "the world and the hello of a"


def moe_devices(coordinator, workers) -> list[planner.Node]:
    """A slow coordinator with room for the experts of three blocks, a fast worker with room for every
    block's attention and the experts of one, and a slow worker with much memory; loopback-fast links."""
    figures = {coordinator: (30, 1.0), workers[0]: (20, 40.0), workers[1]: (8000, 1.0)}
    Device.objects.filter(node__in=figures).delete()
    nodes = []
    for node, (mib, bw) in figures.items():
        Device.objects.create(node=node, name="CPU", kind=DeviceKind.CPU, total_bytes=mib * MIB,
                              free_bytes=mib * MIB, bandwidth_gbs=bw)  # fmt: skip
        device = planner.Device(node.name, "CPU", "cpu", mib * MIB, mib * MIB, bw)
        remote = {} if node == coordinator else {"rpc_port": node.rpc_port, "rtt_ms": 0.05, "hop_ms": 0.05}
        nodes.append(
            planner.Node(node.name, node.address, (device,), coordinator=node == coordinator, **remote)
        )
    return nodes


def test_a_mixture_of_experts_with_experts_apart_answers_token_for_token_as_one_machine(
    lab, lab_hosts, tmp_path, monkeypatch
):
    binaries = require_llamacpp()
    gguf = write_tiny_llama(tmp_path / "moe.gguf", MOE)
    hosts = lab_hosts(3)
    route_between(hosts)
    operator = UserFactory(username="oscar-operator", role="operator")
    coordinator = ready_node(lab, hosts[0], "desk", may_coordinate=True)
    workers = [ready_node(lab, host, f"old-pc-{i}") for i, host in enumerate(hosts[1:], start=1)]
    nodes = moe_devices(coordinator, workers)
    profile = profile_path(gguf)
    model = ModelFile.objects.create(
        name="moe", node=coordinator, path=str(gguf), size_bytes=profile["size_bytes"], profile=profile
    )
    plan = planner.plan(profile, nodes, planner.Settings(ctx=CTX))
    assert plan["fits"] and plan["places_experts"], plan
    by_node = {p["node"]: p for p in plan["placements"]}
    # Every block's attention on old-pc-1; the experts of some on old-pc-2, of others on the desk's CPU.
    assert by_node["old-pc-1"]["layers"] == MOE.n_layer, plan["placements"]
    assert by_node["old-pc-2"]["expert_blocks"] and by_node["desk"]["expert_blocks"], plan["placements"]
    assert "-ot" in plan["llama_server_args"]
    deployment = Deployment.objects.create(
        name="moe split", model_file=model, coordinator=coordinator, plan=plan,
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
        split_tokens = ask(url, key, prompt=MOE_PROMPT)
        server = next(p for p in deployment.processes.values() if p["role"] == "llama-server")
        fa = flash_attention_of(Path(server["log"]).read_text(errors="replace"))
    finally:
        record_enqueued(monkeypatch)
        stopped, _ = lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk), operator)
        if stopped:
            run_stop(deployment.pk)
    probs: list[list[float]] = []
    single_tokens, _ = one_machine(
        binaries, gguf, plan, fa, tmp_path / "single.log", prompt=MOE_PROMPT, probs=probs,
        extra=("--no-repack",),
    )  # fmt: skip
    gaps = [p[0] - p[1] for p in probs if len(p) == 2]
    differ = next(
        (i for i, (a, b) in enumerate(zip(split_tokens, single_tokens, strict=True)) if a != b), None
    )
    smallest = min(gaps, default=float("nan"))
    print(f"\nMoE split (experts apart, fa {fa}): {N_PREDICT} tokens, first difference at {differ}; "
          f"smallest top-1/top-2 log-probability gap on one machine {smallest:.2e}")  # fmt: skip
    assert split_tokens == single_tokens, (differ, probs[differ] if differ is not None and probs else None)
