"""`manage.py plan`: the command-line contract scripts depend on (names, JSON keys, exit codes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from tests.paths import ROOT

CLUSTER = {
    "nodes": [
        {
            "name": "desk",
            "coordinator": True,
            "address": "192.168.1.10",
            "devices": [
                {
                    "name": "CUDA0",
                    "kind": "cuda",
                    "total_mib": 24576,
                    "free_mib": 23500,
                    "bandwidth_gbs": 936,
                },
                {"name": "CPU", "kind": "cpu", "total_mib": 65536, "free_mib": 58000, "bandwidth_gbs": 60},
            ],
        },
        {
            "name": "mac",
            "address": "192.168.1.102",
            "rpc_port": 50052,
            "rtt_ms": 0.8,
            "devices": [
                {
                    "name": "MTL0",
                    "kind": "metal",
                    "unified": True,
                    "total_mib": 32768,
                    "free_mib": 32768,
                    "bandwidth_gbs": 400,
                }
            ],
        },
        {
            "name": "old-pc",
            "address": "192.168.1.101",
            "rtt_ms": 0.4,
            "devices": [
                {"name": "CPU", "kind": "cpu", "total_mib": 32768, "free_mib": 30000, "bandwidth_gbs": 25}
            ],
        },
    ]
}
TINY_CLUSTER = {
    "nodes": [
        {
            "name": "desk",
            "coordinator": True,
            "address": "127.0.0.1",
            "devices": [{"name": "CPU", "kind": "cpu", "total_mib": 40, "free_mib": 40, "bandwidth_gbs": 20}],
        },
        {
            "name": "pc",
            "address": "127.0.0.1",
            "rpc_port": 50100,
            "rtt_ms": 0.1,
            "devices": [{"name": "CPU", "kind": "cpu", "total_mib": 40, "free_mib": 40, "bandwidth_gbs": 60}],
        },
    ]
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", TinyLlama())


def run_plan(
    tmp_path: Path, model: Path | str, cluster: dict | str, *extra: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    cluster_path = tmp_path / "cluster.json"
    cluster_path.write_text(cluster if isinstance(cluster, str) else json.dumps(cluster))
    argv = [
        sys.executable,
        "manage.py",
        "plan",
        "--model",
        str(model),
        "--cluster",
        str(cluster_path),
        *extra,
    ]
    return subprocess.run(
        argv + ["--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_a_fitting_model_prints_the_plan_and_exits_zero(tmp_path, model):
    proc = run_plan(tmp_path, model, CLUSTER, "--ctx", "2048", "--parallel", "2", "--cache-type", "q8_0")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    for key in (
        "fits",
        "n_layer",
        "placements",
        "predicted_tokens_per_s",
        "baseline",
        "llama_server_args",
        "rpc_servers",
        "warnings",
        "suggestions",
    ):
        assert key in plan
    assert plan["fits"] is True and plan["n_layer"] == 8
    for key in ("fits", "placements", "predicted_tokens_per_s"):
        assert key in plan["baseline"]
    for p in plan["placements"]:
        for key in (
            "node",
            "device",
            "llama_device",
            "endpoint",
            "layers",
            "output_layer",
            "weights_bytes",
            "kv_bytes",
            "compute_bytes",
            "capacity_bytes",
        ):
            assert key in p
    args = plan["llama_server_args"]
    assert args[args.index("-c") + 1] == "2048" and args[args.index("-np") + 1] == "2"
    assert args[args.index("-ctk") + 1] == "q8_0" and args[args.index("-ctv") + 1] == "q8_0"
    assert args[args.index("--fit") : args.index("--fit") + 2] == ["--fit", "off"]
    assert args[args.index("-sm") : args.index("-sm") + 2] == ["-sm", "layer"]


def test_a_model_that_does_not_fit_prints_fits_false_and_exits_three(tmp_path, model):
    proc = run_plan(tmp_path, model, TINY_CLUSTER, "--ctx", "65536")
    assert proc.returncode == 3, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["fits"] is False
    assert plan["suggestions"] and all(s["fits"] for s in plan["suggestions"])
    assert any(s["change"] == "ctx" for s in plan["suggestions"])


def test_the_clamp_option_limits_unified_memory(tmp_path, model):
    proc = run_plan(tmp_path, model, CLUSTER, "--clamp", "0.5")
    baseline_mac = [p for p in json.loads(proc.stdout)["baseline"]["placements"] if p["device"] == "MTL0"][0]
    assert baseline_mac["limit_bytes"] == 16384 * 1024 * 1024


@pytest.mark.parametrize(
    ("model_name", "cluster", "extra", "message"),
    [
        ("missing.gguf", CLUSTER, (), "No such file"),
        ("not-gguf", CLUSTER, (), "not a GGUF file"),
        (None, "{not json", (), "not valid JSON"),
        (None, {"nodes": []}, (), "nodes"),
        (None, CLUSTER, ("--ctx", "0"), "context"),
        (None, CLUSTER, ("--cache-type", "q5_1"), "invalid choice"),
        (None, CLUSTER, ("--clamp", "3"), "clamp"),
    ],
)
def test_bad_input_exits_two_with_a_message(tmp_path, model, model_name, cluster, extra, message):
    path = model
    if model_name == "not-gguf":
        path = tmp_path / "notes.txt"
        path.write_text("hello, I am not a model")
    elif model_name:
        path = tmp_path / model_name
    proc = run_plan(tmp_path, path, cluster, *extra)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


MAC_COORDINATOR = {
    "nodes": [
        {
            "name": "mac",
            "coordinator": True,
            "address": "192.168.1.20",
            "devices": [
                {"name": "MTL0", "kind": "metal", "unified": True, "total_mib": 32768, "bandwidth_gbs": 200}
            ],
        },
        {
            "name": "old-pc",
            "address": "192.168.1.101",
            "rtt_ms": 0.4,
            "devices": [{"name": "CPU", "kind": "cpu", "total_mib": 16384, "bandwidth_gbs": 25}],
        },
    ]
}


def test_a_mac_described_by_its_mtl0_alone_coordinates(tmp_path, model):
    proc = run_plan(tmp_path, model, MAC_COORDINATOR)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["fits"] and plan["coordinator"] == "mac"
    cpu, metal = plan["placements"][:2]
    assert (cpu["node"], cpu["llama_device"], cpu["limit_basis"]) == ("mac", "CPU", "pool")
    assert (metal["node"], metal["llama_device"], metal["endpoint"]) == ("mac", "MTL0", None)
    assert cpu["weights_bytes"] > 0  # the input embedding, from the Mac's one memory
    pool = plan["unified_pool"]
    assert pool["limit_bytes"] == int(0.70 * 32768 * 1024 * 1024)
    assert cpu["used_bytes"] + metal["used_bytes"] == pool["used_bytes"] <= pool["capacity_bytes"]
    args = plan["llama_server_args"]
    assert args[args.index("--device") + 1] == "MTL0"


def test_the_clamp_defaults_to_the_setting_and_a_wired_limit_in_the_cluster_file_caps_metal(tmp_path, model):
    cluster = json.loads(json.dumps(MAC_COORDINATOR))
    proc = run_plan(tmp_path, model, cluster, env={"RAMDECK_UNIFIED_MEMORY_CLAMP": "0.5"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["unified_pool"]["limit_bytes"] == 16384 * 1024 * 1024
    cluster["nodes"][0]["devices"][0]["wired_limit_mib"] = 8192
    plan = json.loads(run_plan(tmp_path, model, cluster, "--clamp", "0.9").stdout)
    metal = next(p for p in plan["placements"] if p["device"] == "MTL0")
    assert (metal["limit_bytes"], metal["limit_basis"]) == (8192 * 1024 * 1024, "wired_limit")
    assert plan["unified_pool"]["limit_bytes"] == int(0.9 * 32768 * 1024 * 1024)


def test_a_coordinator_with_neither_cpu_nor_unified_memory_is_bad_input(tmp_path, model):
    cluster = {"nodes": [{"name": "box", "coordinator": True, "devices": [
        {"name": "CUDA0", "kind": "cuda", "total_mib": 24576}]}]}  # fmt: skip
    proc = run_plan(tmp_path, model, cluster)
    assert proc.returncode == 2
    assert "needs a CPU device (its RAM) or a unified-memory device" in proc.stderr
