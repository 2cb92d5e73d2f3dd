"""Layers on a Vulkan device, for real: a lab worker runs the Vulkan build's ggml-rpc-server on Mesa's CPU
Vulkan driver (llvmpipe), and the console probes it, records its build with the devices its banner lists,
plans layers of the real model (SmolLM2-135M-Instruct) on its Vulkan0, deploys through its own jobs, and the
model answers; llama.cpp's logs show the weights went to that device.

llama.cpp's Vulkan backend never takes a CPU device of its own accord (ggml-vulkan.cpp); a person makes it
take llvmpipe with GGML_VK_VISIBLE_DEVICES=0. The worker's sshd sets it for every session (`SetEnv`, as a
node's owner would in its sshd_config or shell profile), so the probe, the build's banner read and the
rpc-server the deployment starts all see it, as on such a node. Lab hosts share this machine's file system:
the worker's install is a folder holding the cached Vulkan build's ggml-rpc-server and, as an install needs
both, the CPU build's llama-server of the same source (a worker never runs it; the coordinator runs its
own, the CPU build's, with Vulkan0 reached over RPC).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from builds.offers import plan_device_refusal
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from deployments.steps import checks
from jobs.models import Job, JobState
from llamacpp.gguf import profile_path
from llamacpp.logs import parse_load_log, placement_key
from modelfiles.models import ModelFile
from nodes.pool import planner_nodes
from planning import planner
from tests.deploy_fixtures import (
    LLAMA_PORT,
    lab_node,
    log_text,
    ready_node,
    record_enqueued,
    route_between,
    run,
)
from tests.factories import UserFactory
from tests.llamacpp_build import VULKAN, require_llamacpp
from tests.real_model import require_real_model
from tests.runs import run_deployment, run_stop

pytestmark = [
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.vulkan,
    pytest.mark.timeout(900),
    pytest.mark.django_db(transaction=True),
]

CTX = 512
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def vulkan_install(folder: Path) -> Path:
    """A llama.cpp install whose ggml-rpc-server is the Vulkan build's (see the module's docstring)."""
    cpu, vulkan = require_llamacpp(), require_llamacpp(VULKAN)
    folder.mkdir()
    (folder / vulkan.rpc_server.name).symlink_to(vulkan.rpc_server)
    (folder / "llama-server").symlink_to(cpu.llama_server)
    return folder


def test_the_console_places_layers_on_a_vulkan_device_and_the_model_answers(
    lab, lab_hosts, tmp_path, monkeypatch, settings
):
    started = time.monotonic()
    # llvmpipe decodes this model at about one token a second on two shared cores: the deployment's speed
    # measurement (3 x 128 tokens) would take ten minutes. One short sample still runs it; the placement, not
    # the speed, is what this test checks.
    monkeypatch.setattr(checks, "MEASURE_TOKENS", 16)
    monkeypatch.setattr(checks, "MEASURE_SAMPLES", 1)
    # llvmpipe compiles every compute shader with LLVM when llama-server's warm-up first uses it (Mesa's
    # shader cache is empty under CI's fresh HOME): that first load took over a minute here, past the
    # minute-plus-30-s-per-GiB a GPU gets.
    settings.RAMDECK_HEALTH_TIMEOUT_PER_GIB_S = 3000.0
    install = vulkan_install(tmp_path / "llama.cpp-vulkan")
    gguf = require_real_model()
    desk_host, box_host = lab_hosts(2)
    lab.start_sshd(box_host, extra_config=["SetEnv GGML_VK_VISIBLE_DEVICES=0"])
    route_between([desk_host, box_host])
    operator = UserFactory(username="oscar-operator", role="operator")
    record_enqueued(monkeypatch)  # the calibration a first build queues is not run here
    coordinator = ready_node(lab, desk_host, "desk", may_coordinate=True)
    worker = lab_node(lab, box_host, name="mini-pc")

    # The probe: llvmpipe, which GGML_VK_VISIBLE_DEVICES gives llama.cpp, is Vulkan0 and the system's RAM.
    probe = run(Job.objects.create(kind="probe", node=worker, created_by=operator))
    assert probe.state == JobState.SUCCEEDED, probe.result
    assert [(d.name, d.kind, d.unified_memory) for d in worker.devices.all()] == [("Vulkan0", "vulkan", True)]
    vulkan0 = worker.devices.get(name="Vulkan0")
    assert vulkan0.description.startswith("llvmpipe"), vulkan0.description

    # The build, registered as an existing install: its rpc-server's own banner says what it offers.
    job = run(
        Job.objects.create(
            kind="build",
            node=worker,
            created_by=operator,
            params={"source": "existing", "path": str(install)},
        )
    )
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-3000:])
    build = worker.current_build
    assert build.backend == "vulkan", build.devices
    [offered] = build.devices
    assert offered["name"] == "Vulkan0" and offered["description"].startswith("llvmpipe"), offered
    assert 0 < offered["free_mib"] <= offered["total_mib"], offered
    assert "its rpc-server offers Vulkan0 (" in log_text(job)

    # The plan: the desk is slow (its figure set by hand), so the blocks go to the worker's Vulkan0.
    coordinator.devices.filter(name="CPU").update(bandwidth_override_gbs=2.0)
    vulkan0.bandwidth_override_gbs = 40.0
    vulkan0.save(update_fields=["bandwidth_override_gbs"])
    profile = profile_path(gguf)
    model = ModelFile.objects.create(
        name="SmolLM2", node=coordinator, path=str(gguf), size_bytes=profile["size_bytes"], profile=profile
    )
    plan = planner.plan(profile, planner_nodes([coordinator, worker], coordinator), planner.Settings(ctx=CTX))
    assert plan["fits"], plan
    [on_vulkan] = [p for p in plan["placements"] if p["node"] == "mini-pc"]
    assert on_vulkan["device"] == "Vulkan0" and on_vulkan["layers"] > 0, plan["placements"]
    assert plan_device_refusal(plan) == ""
    deployment = Deployment.objects.create(
        name="SmolLM2 on Vulkan", model_file=model, coordinator=coordinator, plan=plan,
        plan_settings=plan["settings"], port=LLAMA_PORT, created_by=operator,
    )  # fmt: skip

    record_enqueued(monkeypatch)
    ok, message = lifecycle.start_deploy(deployment, operator)
    assert ok, message
    deploy_started = time.monotonic()
    try:
        run_deployment(deployment.pk)
        deployment.refresh_from_db()
        deploy_s = time.monotonic() - deploy_started
        processes = list(deployment.processes.values())
        logs = {f"{p['role']}@{p['node']}": Path(p["log"]).read_text(errors="replace") for p in processes}
        assert deployment.state == DeploymentState.RUNNING, (
            deployment.failed_step,
            deployment.state_reason,
            {name: text[-3000:] for name, text in logs.items()},
        )
        assert deployment.verification["problems"] == [], deployment.verification
        url, key = f"http://{coordinator.address}:{LLAMA_PORT}", deployment.api_key()
        body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "seed": 1234, "cache_prompt": False}
        answer = httpx.post(
            f"{url}/completion", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600
        )
        assert answer.status_code == 200, answer.text[:2000]
        text = answer.json()["content"]
        server_log, rpc_log = logs["llama-server@desk"], logs["rpc-server@mini-pc"]
    finally:
        record_enqueued(monkeypatch)
        stopped, _ = lifecycle.stop_deployment(Deployment.objects.get(pk=deployment.pk), operator)
        if stopped:
            run_stop(deployment.pk)

    # The worker's rpc-server served Vulkan0 only, and that device is llvmpipe through ggml's Vulkan backend.
    assert re.search(r"^\s+Vulkan0: llvmpipe .*MiB free\)", rpc_log, flags=re.M), rpc_log[-3000:]
    assert "ggml_vulkan: 0 = llvmpipe" in rpc_log, rpc_log[-3000:]
    # llama-server put the planned blocks' weights (and their KV cache) in that server's buffers.
    # llama-server reaches the worker's rpc-server through the deployment's SSH tunnel (rpc_guard.py),
    # so its RPC0 is the tunnel's loopback end: the deployment's one RPC server, the worker's.
    buffers = [line for line in server_log.splitlines() if "buffer size" in line or "using device" in line]
    [endpoint] = set(re.findall(r"using device RPC0 \(([^)]+)\)", server_log)) or {placement_key(on_vulkan)}
    logged = parse_load_log(server_log.splitlines())["devices"].get(endpoint)
    assert logged and logged["model"] > 0 and logged["kv"] > 0, (endpoint, buffers)
    model_line = re.search(rf"RPC0\[{re.escape(endpoint)}\] model buffer size = +[\d.]+ MiB", server_log)
    assert model_line, (endpoint, buffers)
    assert "Paris" in text, text
    figures = {
        "vulkan0_layers": on_vulkan["layers"],
        "vulkan0_model_mib": round(logged["model"] / 2**20, 2),
        "banner_free_mib": offered["free_mib"],
        "deploy_s": round(deploy_s, 1),
        "test_s": round(time.monotonic() - started, 1),
        "answer": text.strip()[:80],
    }
    print(f"\n{model_line[0]}\nVULKAN " + json.dumps(figures))
